"""Conversion between our Llama 3 state dict / args and the Hugging Face `LlamaForCausalLM` layout.

Besides renaming, q and k projections need their output rows permuted within each head: our RoPE rotates
adjacent pairs (2j, 2j+1) as complex numbers, HF's rotate_half rotates dims (j, j + head_dim/2). With the
same frequency for pair j in both, moving row 2j to j and row 2j+1 to j + head_dim/2 makes HF's attention
compute exactly ours (q.k is unchanged when q and k rows are permuted alike).
"""

import importlib.metadata
import re

import torch

from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

# Inside `layers.{i}.` (ours) <-> inside `model.layers.{i}.` (HF).
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_KEYS_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_TOP_KEYS_FROM_HF = {v: k for k, v in _TOP_KEYS.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # Rows of a head viewed as [pair j, re/im]; HF wants all re rows, then all im rows.
    return w.unflatten(0, (n_heads, -1, 2)).transpose(1, 2).reshape(w.shape)


def _half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    return w.unflatten(0, (n_heads, 2, -1)).transpose(1, 2).reshape(w.shape)


class Llama3StateDictAdapter(StateDictAdapter):
    args: TransformerModelArgs

    @staticmethod
    def to_hf_config(args: TransformerModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        return to_hf_config(args, dtype)

    @staticmethod
    def from_hf_config(config: dict) -> TransformerModelArgs:
        return from_hf_config(config)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names; works on any subset (e.g. one pipeline stage's state dict)."""
        hf = {}
        for key, t in state_dict.items():
            if key in _TOP_KEYS:
                hf[_TOP_KEYS[key]] = t
                continue
            match = _OURS_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _LAYER_KEYS:
                raise KeyError(f"no Hugging Face name for {key!r}")
            layer, name = match.groups()
            if name == "attention.wq.weight":
                t = _interleaved_to_half(t, self.args.n_heads)
            elif name == "attention.wk.weight":
                t = _interleaved_to_half(t, self.args.num_kv_heads)
            hf[f"model.layers.{layer}.{_LAYER_KEYS[name]}"] = t
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = {}
        for key, t in hf_state_dict.items():
            if key.endswith("rotary_emb.inv_freq"):  # a derived buffer some older HF checkpoints saved
                continue
            if key in _TOP_KEYS_FROM_HF:
                ours[_TOP_KEYS_FROM_HF[key]] = t
                continue
            match = _HF_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _LAYER_KEYS_FROM_HF:
                raise KeyError(f"unsupported Hugging Face weight {key!r}")
            layer, hf_name = match.groups()
            name = _LAYER_KEYS_FROM_HF[hf_name]
            if name == "attention.wq.weight":
                t = _half_to_interleaved(t, self.args.n_heads)
            elif name == "attention.wk.weight":
                t = _half_to_interleaved(t, self.args.num_kv_heads)
            ours[f"layers.{layer}.{name}"] = t
        return ours


def _transformers_major() -> int | None:
    try:
        return int(importlib.metadata.version("transformers").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return None


def to_hf_config(args: TransformerModelArgs, dtype: torch.dtype = torch.bfloat16, layout: int | None = None) -> dict:
    """Contents of an HF `config.json` for these args (weights stored in `dtype`).

    `layout` 5 writes RoPE the way transformers 5.x does (`rope_parameters` holding rope_theta, rope_type and
    the scaling) and `dtype`; 4 writes transformers 4.x's top-level `rope_theta` / `rope_scaling` and
    `torch_dtype`, which 5.x also reads. None = the installed transformers' layout (4 when none is installed)."""
    layout = layout or (5 if (_transformers_major() or 4) >= 5 else 4)
    scaling = {"rope_type": "default"}
    if args.rope_scaling is not None:
        s = args.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    if layout >= 5:
        rope = {"rope_parameters": {"rope_theta": args.rope_theta, **scaling}}
        dtype_key = "dtype"
    else:
        rope = {"rope_theta": args.rope_theta, "rope_scaling": scaling if args.rope_scaling is not None else None}
        dtype_key = "torch_dtype"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        **rope,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        dtype_key: str(dtype).removeprefix("torch."),
    }


def _rope_from_hf(config: dict) -> tuple[float, RopeScalingArgs | None]:
    """(rope_theta, scaling) from either layout: 5.x `rope_parameters`, or 4.x top-level `rope_theta` and
    `rope_scaling` (whose older spelling of rope_type is `type`)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    else:
        params = config.get("rope_scaling") or {}
        theta = config.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"RoPE type {rope_type!r} is not supported for Llama 3 (default or llama3)")
    return float(theta), RopeScalingArgs(
        factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
    )


def from_hf_config(config: dict) -> TransformerModelArgs:
    """Args reproducing an HF Llama config (transformers 4.x or 5.x layout). The FFN size is taken verbatim
    (`ffn_hidden_dim`) since the recipe that produced it (multiple_of, ffn_dim_multiplier) is not recorded."""
    n_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // n_heads
    if (config.get("head_dim") or head_dim) != head_dim:
        raise ValueError(
            f"head_dim {config['head_dim']} != hidden_size / num_attention_heads ({head_dim}): not supported"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (Llama uses silu)")
    rope_theta, rope_scaling = _rope_from_hf(config)
    return TransformerModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=config["max_position_embeddings"],
    )
