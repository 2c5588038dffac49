"""Conversion between our Llama 3 state dict / args and the Hugging Face `LlamaForCausalLM` layout.

Besides renaming, q and k projections need their output rows permuted within each head: our RoPE rotates
adjacent pairs (2j, 2j+1) as complex numbers, HF's rotate_half rotates dims (j, j + head_dim/2). With the
same frequency for pair j in both, moving row 2j to j and row 2j+1 to j + head_dim/2 makes HF's attention
compute exactly ours (q.k is unchanged when q and k rows are permuted alike).
"""

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


def to_hf_config(args: TransformerModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Contents of an HF `config.json` for these args (weights stored in `dtype`)."""
    rope_scaling = None
    if args.rope_scaling is not None:
        s = args.rope_scaling
        rope_scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
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
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": args.max_seq_len,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def from_hf_config(config: dict) -> TransformerModelArgs:
    """Args reproducing an HF Llama config. The FFN size is taken verbatim (`ffn_hidden_dim`) since the
    recipe that produced it (multiple_of, ffn_dim_multiplier) is not recorded."""
    n_heads = config["num_attention_heads"]
    head_dim = config["hidden_size"] // n_heads
    if config.get("head_dim", head_dim) != head_dim:
        raise NotImplementedError(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    if config.get("hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {config['hidden_act']!r}")
    rope_scaling = None
    if config.get("rope_scaling"):
        s = config["rope_scaling"]
        rope_type = s.get("rope_type", s.get("type"))
        if rope_type != "llama3":
            raise NotImplementedError(f"rope_scaling type {rope_type!r}")
        rope_scaling = RopeScalingArgs(
            factor=s["factor"],
            low_freq_factor=s["low_freq_factor"],
            high_freq_factor=s["high_freq_factor"],
            original_max_position_embeddings=s["original_max_position_embeddings"],
        )
    return TransformerModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads", n_heads),
        vocab_size=config["vocab_size"],
        ffn_hidden_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        max_seq_len=config["max_position_embeddings"],
    )

