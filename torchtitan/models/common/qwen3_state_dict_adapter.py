"""Conversion between our Qwen3 state dict / args and the Hugging Face `Qwen3ForCausalLM` layout.

Only names change: our RoPE uses the same half layout as HF's rotate_half, so q and k rows need no
permutation (unlike the Llama 3 adapter). Tied models: HF folders store the matrix once, as the embedding;
`to_hf` drops our `output.weight` (the same tensor), and the shared folder reader copies the embedding into
`lm_head.weight` when loading, which `from_hf` maps back to `output.weight`.
"""

import re

import torch

from torchtitan.models.common.qwen3_args import Qwen3ModelArgs
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig, rope_dict
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

# Inside `layers.{i}.` (ours) <-> inside `model.layers.{i}.` (HF).
_LAYER_KEYS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
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


class Qwen3StateDictAdapter(StateDictAdapter):
    args: Qwen3ModelArgs
    HF_MODEL_TYPES = ("qwen3",)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names; works on any subset (e.g. one pipeline stage's state dict)."""
        hf = {}
        for key, t in state_dict.items():
            if key == "output.weight" and self.args.tie_embeddings:
                continue  # the embedding, stored once
            if key in _TOP_KEYS:
                hf[_TOP_KEYS[key]] = t
                continue
            match = _OURS_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _LAYER_KEYS:
                raise KeyError(f"no Hugging Face name for {key!r}")
            layer, name = match.groups()
            hf[f"model.layers.{layer}.{_LAYER_KEYS[name]}"] = t
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = {}
        for key, t in hf_state_dict.items():
            if key in _TOP_KEYS_FROM_HF:
                ours[_TOP_KEYS_FROM_HF[key]] = t
                continue
            match = _HF_LAYER.fullmatch(key)
            if match is None or match.group(2) not in _LAYER_KEYS_FROM_HF:
                raise KeyError(f"unsupported Hugging Face weight {key!r}")
            layer, hf_name = match.groups()
            ours[f"layers.{layer}.{_LAYER_KEYS_FROM_HF[hf_name]}"] = t
        if self.args.tie_embeddings and "tok_embeddings.weight" in ours:
            ours.setdefault("output.weight", ours["tok_embeddings.weight"])
        return ours

    @staticmethod
    def to_hf_config(args: Qwen3ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        """Contents of an HF `config.json` for these args (weights stored in `dtype`). RoPE is written both the
        way the published configs do (`rope_theta`) and the way transformers 5 does (`rope_parameters`)."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": args.dim,
            "intermediate_size": args.hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_theta": args.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "max_position_embeddings": args.max_seq_len,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": args.tie_embeddings,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> Qwen3ModelArgs:
        """Args reproducing an HF Qwen3 config; every key is read or refused (protocols/hf_config.py)."""
        r = HFConfigReader(config, where, "Qwen3 (--model.name qwen3)")
        args = read_qwen3_config(r)
        r.finish()
        return args


def read_qwen3_config(r: HFConfigReader) -> Qwen3ModelArgs:
    """The dense Qwen3 part of a config (also the attention of Qwen3-MoE), read through `r`."""
    r.expect("hidden_act", "silu", "silu")
    r.expect("attention_bias", False, False)
    r.expect("attention_dropout", 0.0, 0.0)
    r.expect("use_sliding_window", False, False)
    r.ignore("sliding_window", "max_window_layers")  # only used with use_sliding_window
    layer_types = r.opt("layer_types", [])
    if any(t != "full_attention" for t in layer_types):
        raise UnsupportedHFConfig(f"{r.where}: layer_types {sorted(set(layer_types))}: only full attention is supported")
    rope = HFConfigReader(rope_dict(r), f"{r.where} rope parameters", r.family)
    rope.expect("rope_type", "default", "default")
    theta = float(rope.req("rope_theta"))
    rope.finish()
    n_heads = int(r.req("num_attention_heads"))
    return Qwen3ModelArgs(
        dim=int(r.req("hidden_size")),
        n_layers=int(r.req("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(r.opt("num_key_value_heads", n_heads)),
        head_dim=int(r.opt("head_dim", r.req("hidden_size") // n_heads)),
        hidden_dim=int(r.req("intermediate_size")),
        vocab_size=int(r.req("vocab_size")),
        norm_eps=float(r.opt("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_seq_len=int(r.req("max_position_embeddings")),
        tie_embeddings=bool(r.opt("tie_word_embeddings", False)),
    )
