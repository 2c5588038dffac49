"""Conversion between our GPT-OSS state dict / args and the Hugging Face `GptOssForCausalLM` layout.

Every tensor is a rename: the routed experts are held in HF's layout ([E, ...], gate and up interleaved),
which is also what lets EP, FSDP and per-rank reads split them on dim 0. The published folders store the
experts' weights in MXFP4 (`*_blocks` / `*_scales`): `hf_reader` dequantizes them as they are read, each rank
reading only its experts' blocks (mxfp4.py). Saving writes plain bf16 / float32 tensors under the names
`from_pretrained` loads without a quantizer.

HF's router has a learned bias but no balancing bias: a model whose balancing bias moved (aux-loss-free
balancing, --moe.load_balance_coeff > 0) is refused on export, since dropping it would change the routing.
"""

import re

import torch

from torchtitan.models.gpt_oss.args import FULL, SLIDING, GptOssModelArgs, gpt_oss_moe
from torchtitan.models.gpt_oss.mxfp4 import Mxfp4Reader
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig, rope_dict
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attention.w{p}.{t}": f"self_attn.{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias")},
    "attention.sinks.weight": "self_attn.sinks",
    "moe.router.gate.weight": "mlp.router.weight",
    "moe.router.gate.bias": "mlp.router.bias",
    "moe.experts.gate_up": "mlp.experts.gate_up_proj",
    "moe.experts.gate_up_bias": "mlp.experts.gate_up_proj_bias",
    "moe.experts.down": "mlp.experts.down_proj",
    "moe.experts.down_bias": "mlp.experts.down_proj_bias",
}
_FROM_BLOCK = {v: k for k, v in _BLOCK.items()}
_FROM_TOP = {v: k for k, v in _TOP.items()}
_OURS = re.compile(r"layers\.(\d+)\.(.+)")
_HF = re.compile(r"model\.layers\.(\d+)\.(.+)")
_BALANCE_BIAS = "moe.expert_bias"


class GptOssStateDictAdapter(StateDictAdapter):
    args: GptOssModelArgs
    HF_MODEL_TYPES = ("gpt_oss",)
    HF_KEEPS_EXPERT_BIAS = False  # its router bias is learned, not the balancing one
    # Training settings, not the model: a job may train a folder's weights with another balance loss weight.
    HF_CONFIG_NOT_COMPARED = StateDictAdapter.HF_CONFIG_NOT_COMPARED | {"output_router_logits", "router_aux_loss_coef"}

    def hf_layout(self, key: str, shape: torch.Size):
        m = _OURS.fullmatch(key)
        if m and m.group(2) == _BALANCE_BIAS:
            return None  # HF's router has no balancing bias; to_hf refuses a moved one
        return super().hf_layout(key, shape)

    def hf_reader(self, reader):
        return Mxfp4Reader(reader)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = {}
        for key, t in state_dict.items():
            if key in _TOP:
                hf[_TOP[key]] = t
                continue
            m = _OURS.fullmatch(key)
            if m and m.group(2) == _BALANCE_BIAS:
                if t.abs().max() > 0:
                    raise ValueError(
                        f"{key} is non-zero (trained with --moe.load_balance_coeff > 0), and Hugging Face's GPT-OSS "
                        f"router has no balancing bias: exporting would change the routing; train with "
                        f"--moe.load_balance_coeff 0 to export to that format"
                    )
            elif m and m.group(2) in _BLOCK:
                hf[f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"] = t
            else:
                raise KeyError(f"{key}: no Hugging Face GPT-OSS name for this tensor")
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours = {}
        for key, t in hf_state_dict.items():
            if key in _FROM_TOP:
                ours[_FROM_TOP[key]] = t
                continue
            m = _HF.fullmatch(key)
            if not (m and m.group(2) in _FROM_BLOCK):
                raise KeyError(f"{key}: not a tensor of GPT-OSS (a checkpoint of another model?)")
            ours[f"layers.{m.group(1)}.{_FROM_BLOCK[m.group(2)]}"] = t
            if m.group(2) == "mlp.router.weight":
                ours[f"layers.{m.group(1)}.{_BALANCE_BIAS}"] = torch.zeros(t.shape[0], dtype=torch.float32)
        return ours

    @staticmethod
    def to_hf_config(args: GptOssModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        m = args.moe
        if (m.score_func, m.route_norm, m.route_scale, m.num_shared_experts, m.n_groups, m.router_bias,
                m.experts) != ("softmax", True, 1.0, 0, 1, True, "clamped_swiglu"):
            raise ValueError("Hugging Face's GPT-OSS routes by softmax over the top-k of a biased router into "
                             "clamped-SwiGLU experts, without shared experts, groups or scaling")
        rope = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.rope_factor,
                "beta_fast": args.rope_beta_fast, "beta_slow": args.rope_beta_slow,
                "truncate": args.rope_truncate, "original_max_position_embeddings": args.rope_original_seq_len}
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "hidden_size": args.dim,
            "intermediate_size": m.hidden_dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "max_position_embeddings": args.max_seq_len,
            "sliding_window": args.sliding_window,
            "layer_types": [args.layer_type(i) for i in range(args.n_layers)],
            "rope_parameters": rope,
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "swiglu_alpha": m.swiglu_alpha,
            "swiglu_limit": m.swiglu_limit,
            "output_router_logits": m.router_aux_loss_coef > 0,
            "router_aux_loss_coef": m.router_aux_loss_coef,
            "attention_bias": True,
            "attention_dropout": 0.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> GptOssModelArgs:
        """Args of an HF GPT-OSS config (transformers 5 `rope_parameters` or the published `rope_scaling`);
        an MXFP4 `quantization_config` is accepted (its experts are dequantized on load); every key is read or
        refused (protocols/hf_config.py)."""
        r = HFConfigReader(config, where, "GPT-OSS (--model.name gpt_oss)")
        r.expect("hidden_act", "silu", "silu")
        r.expect("attention_bias", True, True)
        r.expect("attention_dropout", 0.0, 0.0)
        r.expect("tie_word_embeddings", False, False)
        quant = r.opt("quantization_config")
        if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
            raise UnsupportedHFConfig(f"{where}: quantization_config {quant!r}: only MXFP4 experts are read")
        r.ignore("experts_per_token", "initial_context_length", "rope_theta", "rope_scaling")
        rope = HFConfigReader(rope_dict(r), f"{where} rope parameters", r.family)
        rope_type = rope.expect("rope_type", ("yarn", "default"), "default")
        n_layers = int(r.req("num_hidden_layers"))
        layer_types = r.opt("layer_types")
        if layer_types is not None and any(t not in (SLIDING, FULL) for t in layer_types):
            raise UnsupportedHFConfig(f"{where}: layer_types {sorted(set(layer_types))}: only {SLIDING} and {FULL}")
        window = r.opt("sliding_window")
        n_heads = int(r.req("num_attention_heads"))
        args = GptOssModelArgs(
            dim=int(r.req("hidden_size")),
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(r.opt("num_key_value_heads", n_heads)),
            head_dim=int(r.opt("head_dim", r.req("hidden_size") // n_heads)),
            vocab_size=int(r.req("vocab_size")),
            norm_eps=float(r.opt("rms_norm_eps", 1e-5)),
            max_seq_len=int(r.req("max_position_embeddings")),
            sliding_window=int(window) if window is not None else 128,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            rope_theta=float(rope.req("rope_theta")),
            rope_factor=float(rope.req("factor")) if rope_type == "yarn" else 1.0,
            rope_original_seq_len=int(rope.opt("original_max_position_embeddings", 4096)),
            rope_beta_fast=float(rope.opt("beta_fast", 32.0)),
            rope_beta_slow=float(rope.opt("beta_slow", 1.0)),
            rope_truncate=bool(rope.opt("truncate", True)),
            moe=gpt_oss_moe(int(r.opt("num_local_experts") or r.req("num_experts")),
                            int(r.req("intermediate_size")), int(r.req("num_experts_per_tok"))),
        )
        if rope.opt("attention_factor") is not None or rope.opt("mscale") or rope.opt("mscale_all_dim"):
            raise UnsupportedHFConfig(f"{where}: YaRN attention_factor / mscale overrides are not supported")
        rope.finish()
        args.moe.swiglu_alpha = float(r.opt("swiglu_alpha", 1.702))
        args.moe.swiglu_limit = float(r.opt("swiglu_limit", 7.0))
        # transformers trains with the load-balancing loss only when output_router_logits is true
        args.moe.router_aux_loss_coef = (
            float(r.opt("router_aux_loss_coef", 0.0)) if r.opt("output_router_logits") else 0.0
        )
        r.ignore("num_experts")
        r.finish()
        return args
