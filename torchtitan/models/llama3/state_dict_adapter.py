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
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig, rope_dict
from torchtitan.protocols.state_dict_adapter import HFLayout, StateDictAdapter

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
    HF_MODEL_TYPES = ("llama",)

    @staticmethod
    def to_hf_config(args: TransformerModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        return to_hf_config(args, dtype)

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> TransformerModelArgs:
        return from_hf_config(config, where)

    def hf_layout(self, key: str, shape: torch.Size) -> HFLayout | None:
        """q/k rows are permuted within each head (see the module docstring): a slice of whole heads converts
        on its own."""
        layout = super().hf_layout(key, shape)
        if key.endswith(("attention.wq.weight", "attention.wk.weight")):
            hd = self.args.head_dim
            layout.row_block = hd
            layout.to_hf_rows = lambda t: _interleaved_to_half(t, t.shape[0] // hd)
            layout.from_hf_rows = lambda t: _half_to_interleaved(t, t.shape[0] // hd)
        return layout

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names; works on any subset (e.g. one pipeline stage's state dict)."""
        hf = {}
        for key, t in state_dict.items():
            if key == "output.weight" and self.args.tie_embeddings:
                continue  # the embedding, stored once (HF folders of tied models hold no lm_head.weight)
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
        if self.args.tie_embeddings and "tok_embeddings.weight" in ours:
            ours.setdefault("output.weight", ours["tok_embeddings.weight"])
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
        "tie_word_embeddings": args.tie_embeddings,
        dtype_key: str(dtype).removeprefix("torch."),
    }


def _rope_from_hf(reader: HFConfigReader) -> tuple[float, RopeScalingArgs | None]:
    """(rope_theta, scaling) from either config layout; a rope type other than default/llama3, or an option
    of it this model does not implement, is refused."""
    rope = HFConfigReader(rope_dict(reader), f"{reader.where} rope parameters", reader.family)
    theta = float(rope.req("rope_theta"))
    kind = rope.expect("rope_type", ("default", "llama3"), "default")
    if kind == "default":
        rope.finish()
        return theta, None
    scaling = RopeScalingArgs(
        factor=float(rope.req("factor")),
        low_freq_factor=float(rope.req("low_freq_factor")),
        high_freq_factor=float(rope.req("high_freq_factor")),
        original_max_position_embeddings=int(rope.req("original_max_position_embeddings")),
    )
    rope.finish()
    return theta, scaling


def from_hf_config(config: dict, where: str = "config.json") -> TransformerModelArgs:
    """Args reproducing an HF Llama config (transformers 4.x or 5.x layout); every key is read or refused
    (protocols/hf_config.py). The FFN size is taken verbatim (`ffn_hidden_dim`) since the recipe that
    produced it (multiple_of, ffn_dim_multiplier) is not recorded."""
    r = HFConfigReader(config, where, "Llama 3 (--model.name llama3)")
    dim, n_heads = int(r.req("hidden_size")), int(r.req("num_attention_heads"))
    head_dim = int(r.opt("head_dim", dim // n_heads))  # transformers' default, also when heads do not divide dim
    if head_dim % 2:
        raise UnsupportedHFConfig(f"{where}: head_dim {head_dim} is odd: RoPE rotates pairs of dimensions")
    r.expect("hidden_act", "silu", "silu")
    r.expect("attention_bias", False, False)
    r.expect("mlp_bias", False, False)
    r.expect("attention_dropout", 0.0, 0.0)
    rope_theta, rope_scaling = _rope_from_hf(r)
    args = TransformerModelArgs(
        dim=dim,
        n_layers=int(r.req("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(r.opt("num_key_value_heads", n_heads)),
        attn_head_dim=None if head_dim == dim // n_heads else head_dim,
        vocab_size=int(r.req("vocab_size")),
        ffn_hidden_dim=int(r.req("intermediate_size")),
        norm_eps=float(r.opt("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=int(r.req("max_position_embeddings")),
        tie_embeddings=bool(r.opt("tie_word_embeddings", False)),
    )
    r.finish()
    return args
