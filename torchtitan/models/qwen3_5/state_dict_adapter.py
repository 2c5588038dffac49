"""Conversion between our Qwen3.5 state dict / args and Hugging Face's `Qwen3_5ForCausalLM` /
`Qwen3_5MoeForCausalLM` (and the language model of the multimodal `Qwen3_5(Moe)ForConditionalGeneration`).

What is more than a rename:
- HF fuses DeltaNet's q, k and v: `in_proj_qkv` and `conv1d` hold q rows, then k rows, then v rows. Ours are
  three tensors each (so TP splits heads alike); each is a row range of the HF tensor (HFLayout.hf_rows), so a
  rank still reads and writes only its slice.
- Routed experts: per-expert HF tensors <-> our stacked ones (components/moe/hf_experts.py). HF's router has no
  balancing bias: a moved one is refused on export (it would change the routing).
- Multimodal folders (model_type qwen3_5 / qwen3_5_moe) nest the language model under `model.language_model.`
  and hold a vision tower (`model.visual.*`) and multi-token-prediction layers (`mtp.*`) this model does not
  have: the language model loads, the rest is named in one line and left out. Any other unknown key is refused.
"""

import dataclasses
import logging
import re

import torch

from torchtitan.components.moe.args import MoEArgs
from torchtitan.components.moe.hf_experts import is_expert_key, stack_experts, unstack_experts
from torchtitan.models.qwen3_5.args import LAYER_TYPES, Qwen3_5ModelArgs
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig, rope_dict
from torchtitan.protocols.state_dict_adapter import HFLayout, StateDictAdapter

logger = logging.getLogger(__name__)

_COMMON = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    # full attention
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    # linear attention (q/k/v and their convs: see _FUSED)
    "attention.in_proj_z.weight": "linear_attn.in_proj_z.weight",
    "attention.in_proj_b.weight": "linear_attn.in_proj_b.weight",
    "attention.in_proj_a.weight": "linear_attn.in_proj_a.weight",
    "attention.decay.A_log": "linear_attn.A_log",
    "attention.decay.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
    "attention.out_proj.weight": "linear_attn.out_proj.weight",
    # dense FFN
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    # MoE (routed experts: see hf_experts)
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.shared_experts.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_expert.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_expert.down_proj.weight",
    "moe.shared_gate.weight": "mlp.shared_expert_gate.weight",
}
_COMMON_FROM_HF = {v: k for k, v in _COMMON.items()}
# Ours -> (HF fused tensor, part index among q, k, v).
_FUSED = {
    "attention.in_proj_q.weight": ("linear_attn.in_proj_qkv.weight", 0),
    "attention.in_proj_k.weight": ("linear_attn.in_proj_qkv.weight", 1),
    "attention.in_proj_v.weight": ("linear_attn.in_proj_qkv.weight", 2),
    "attention.conv.q": ("linear_attn.conv1d.weight", 0),
    "attention.conv.k": ("linear_attn.conv1d.weight", 1),
    "attention.conv.v": ("linear_attn.conv1d.weight", 2),
}
_FUSED_PARTS = {}
for _ours, (_hf, _i) in _FUSED.items():
    _FUSED_PARTS.setdefault(_hf, [None, None, None])[_i] = _ours
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_OURS_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")
_LEFT_OUT = ("model.visual.", "mtp.")


class Qwen3_5StateDictAdapter(StateDictAdapter):
    args: Qwen3_5ModelArgs
    HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    HF_KEEPS_EXPERT_BIAS = False  # the router is a plain linear
    # Training settings, not the model: a job may train a folder's weights with another balance loss weight.
    HF_CONFIG_NOT_COMPARED = StateDictAdapter.HF_CONFIG_NOT_COMPARED | {"output_router_logits", "router_aux_loss_coef"}

    def _split(self) -> tuple[int, int, int]:
        a = self.args
        key_dim = a.linear_num_key_heads * a.linear_key_head_dim
        return key_dim, key_dim, a.linear_num_value_heads * a.linear_value_head_dim

    def hf_layout(self, key: str, shape: torch.Size) -> HFLayout | None:
        if _OURS_BIAS.fullmatch(key):
            return None  # HF's router has no bias; to_hf refuses a moved one
        m = _OURS_LAYER.fullmatch(key)
        if m and m.group(2) in _FUSED:
            hf, part = _FUSED[m.group(2)]
            sizes = self._split()
            return HFLayout([f"{self.args.hf_weight_prefix}layers.{m.group(1)}.{hf}"],
                            row_offset=sum(sizes[:part]), hf_rows=sum(sizes))
        return super().hf_layout(key, shape)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Our FQNs -> HF names; works on any subset. Fused q/k/v parts are concatenated when all three are
        given (a whole state dict), else named by their HF tensor with a `#part` suffix (never written)."""
        prefix = self.args.hf_weight_prefix
        hf, fused = {}, {}
        for key, t in state_dict.items():
            if key == "output.weight":
                if not self.args.tie_embeddings:
                    hf["lm_head.weight"] = t
                continue
            if key == "tok_embeddings.weight":
                hf[f"{prefix}embed_tokens.weight"] = t
                continue
            if key == "norm.weight":
                hf[f"{prefix}norm.weight"] = t
                continue
            if m := _OURS_EXPERTS.fullmatch(key):
                hf.update(unstack_experts(f"{prefix}layers.{m.group(1)}.mlp.experts", m.group(2), t))
                continue
            if _OURS_BIAS.fullmatch(key):
                if t.abs().max() > 0:
                    raise ValueError(
                        f"{key} is non-zero (trained with --moe.load_balance_coeff > 0), and Hugging Face's "
                        f"Qwen3.5-MoE router has no bias: exporting would change the routing; train with "
                        f"--moe.load_balance_coeff 0 to export to that format"
                    )
                continue
            m = _OURS_LAYER.fullmatch(key)
            if m is None or (m.group(2) not in _COMMON and m.group(2) not in _FUSED):
                raise KeyError(f"no Hugging Face name for {key!r}")
            layer, name = m.groups()
            if name in _FUSED:
                hf_name, part = _FUSED[name]
                fused.setdefault(f"{prefix}layers.{layer}.{hf_name}", {})[part] = t
            else:
                hf[f"{prefix}layers.{layer}.{_COMMON[name]}"] = t
        for hf_key, parts in fused.items():
            if len(parts) == 3:
                hf[hf_key] = torch.cat([parts[0], parts[1], parts[2]], dim=0)
            else:
                hf.update({f"{hf_key}#{i}": t for i, t in parts.items()})
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        prefix = self.args.hf_weight_prefix
        left_out = [k for k in hf_state_dict if k.startswith(_LEFT_OUT)]
        if left_out:
            kinds = sorted({"the vision tower (model.visual.*)" if k.startswith("model.visual.") else
                            "the multi-token-prediction layers (mtp.*)" for k in left_out})
            logger.info(f"Qwen3.5: loaded the language model; left out {' and '.join(kinds)}: {len(left_out)} tensors")
        rest = {k: t for k, t in hf_state_dict.items() if not k.startswith(_LEFT_OUT)}
        ours = {}
        experts = {k: t for k, t in rest.items() if is_expert_key(k)}
        for (hf_prefix, w), t in stack_experts(experts).items():
            m = re.fullmatch(re.escape(prefix) + r"layers\.(\d+)\.mlp\.experts", hf_prefix)
            if m is None:
                raise KeyError(f"unsupported Hugging Face weight {hf_prefix}.*")
            ours[f"layers.{m.group(1)}.moe.experts.{w}"] = t
            ours[f"layers.{m.group(1)}.moe.expert_bias"] = torch.zeros(t.shape[0], dtype=torch.float32)
        layer_re = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.+)")
        for key, t in rest.items():
            if key in experts:
                continue
            if key == "lm_head.weight":
                ours["output.weight"] = t
            elif key == f"{prefix}embed_tokens.weight":
                ours["tok_embeddings.weight"] = t
            elif key == f"{prefix}norm.weight":
                ours["norm.weight"] = t
            elif (m := layer_re.fullmatch(key)) and m.group(2) in _COMMON_FROM_HF:
                ours[f"layers.{m.group(1)}.{_COMMON_FROM_HF[m.group(2)]}"] = t
            elif m and m.group(2) in _FUSED_PARTS:
                for name, part in zip(_FUSED_PARTS[m.group(2)], t.split(list(self._split()), dim=0)):
                    ours[f"layers.{m.group(1)}.{name}"] = part
            else:
                raise KeyError(f"unsupported Hugging Face weight {key!r}")
        if self.args.tie_embeddings and "tok_embeddings.weight" in ours:
            ours.setdefault("output.weight", ours["tok_embeddings.weight"])
        return ours

    @staticmethod
    def to_hf_config(args: Qwen3_5ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        """A text-model config.json (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)."""
        config = {
            "architectures": ["Qwen3_5MoeForCausalLM" if args.moe else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_moe_text" if args.moe else "qwen3_5_text",
            "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "num_key_value_heads": args.n_kv_heads,
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            "vocab_size": args.vocab_size,
            "rms_norm_eps": args.norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta,
                                "partial_rotary_factor": args.partial_rotary_factor},
            "max_position_embeddings": args.max_seq_len,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": args.tie_embeddings,
            "layer_types": list(args.layer_kinds),
            "linear_conv_kernel_dim": args.linear_conv_kernel_dim,
            "linear_key_head_dim": args.linear_key_head_dim,
            "linear_value_head_dim": args.linear_value_head_dim,
            "linear_num_key_heads": args.linear_num_key_heads,
            "linear_num_value_heads": args.linear_num_value_heads,
            "torch_dtype": str(dtype).removeprefix("torch."),
        }
        if args.moe is None:
            config["intermediate_size"] = args.hidden_dim
            return config
        m = args.moe
        if (m.score_func != "softmax" or not m.route_norm or m.route_scale != 1.0 or m.n_groups != 1
                or m.num_shared_experts != 1 or not m.shared_gate):
            raise ValueError("Hugging Face's Qwen3.5-MoE routes by softmax top-k (renormalised) with one gated "
                             "shared expert; these MoE args cannot be written as its config")
        config.update({
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.hidden_dim,
            "shared_expert_intermediate_size": m.shared_hidden_dim or m.hidden_dim,
            "output_router_logits": m.router_aux_loss_coef > 0,
            "router_aux_loss_coef": m.router_aux_loss_coef,
        })
        return config

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> Qwen3_5ModelArgs:
        """Args of a text config, or of a multimodal config's `text_config` (its vision settings are left out:
        this model is the language model). Every key is read or refused (protocols/hf_config.py)."""
        prefix = "model."
        if config.get("model_type") in ("qwen3_5", "qwen3_5_moe"):
            outer = HFConfigReader(config, where, "Qwen3.5 (--model.name qwen3_5)")
            text = outer.req("text_config")
            outer.ignore("vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
                         "vision_end_token_id", "tie_word_embeddings")
            outer.finish()
            config = {**text, "tie_word_embeddings": text.get("tie_word_embeddings", config.get("tie_word_embeddings"))}
            where = f"{where} text_config"
            prefix = "model.language_model."
        r = HFConfigReader(config, where, "Qwen3.5 (--model.name qwen3_5)")
        r.expect("hidden_act", "silu", "silu")
        r.expect("attention_bias", False, False)
        r.expect("attention_dropout", 0.0, 0.0)
        # Multi-token prediction layers are not part of this model (their weights are left out on load).
        r.ignore("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "layer_types")
        rope = HFConfigReader(rope_dict(r), f"{where} rope parameters", r.family)
        rope.expect("rope_type", "default", "default")
        # M-RoPE sections only differ from plain RoPE for image/video positions; text positions are equal.
        rope.ignore("mrope_section", "mrope_interleaved")
        theta = float(rope.req("rope_theta"))
        partial = float(rope.opt("partial_rotary_factor", r.opt("partial_rotary_factor", 0.25)))
        rope.finish()
        n_layers = int(r.req("num_hidden_layers"))
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = int(r.opt("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        else:
            r.ignore("full_attention_interval")
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES})
        if bad:
            raise UnsupportedHFConfig(f"{where}: layer type {bad[0]!r} is not supported (supported: {', '.join(LAYER_TYPES)})")
        kernel = int(r.opt("linear_conv_kernel_dim", 4))
        if kernel < 1:
            raise UnsupportedHFConfig(f"{where}: linear_conv_kernel_dim {kernel} must be at least 1")
        n_heads = int(r.req("num_attention_heads"))
        moe = None
        if r.opt("num_experts"):
            moe = MoEArgs(num_experts=int(r.req("num_experts")), num_shared_experts=1,
                          hidden_dim=int(r.req("moe_intermediate_size")), top_k=int(r.req("num_experts_per_tok")),
                          score_func="softmax", route_norm=True, route_scale=1.0,
                          shared_hidden_dim=int(r.req("shared_expert_intermediate_size")), shared_gate=True,
                          # transformers trains with the load-balancing loss only when output_router_logits is true
                          router_aux_loss_coef=float(r.opt("router_aux_loss_coef", 0.0))
                          if r.opt("output_router_logits") else 0.0)
        hidden = int(r.opt("intermediate_size", 0) or (moe.hidden_dim if moe else r.req("intermediate_size")))
        args = dict(
            dim=int(r.req("hidden_size")), n_layers=n_layers, vocab_size=int(r.req("vocab_size")),
            norm_eps=float(r.opt("rms_norm_eps", 1e-6)), max_seq_len=int(r.req("max_position_embeddings")),
            tie_embeddings=bool(r.opt("tie_word_embeddings", False)), hidden_dim=hidden,
            layer_types=tuple(layer_types), n_heads=n_heads, n_kv_heads=int(r.opt("num_key_value_heads", n_heads)),
            head_dim=int(r.opt("head_dim", int(r.req("hidden_size")) // n_heads)), rope_theta=theta,
            partial_rotary_factor=partial,
            linear_num_key_heads=int(r.req("linear_num_key_heads")),
            linear_num_value_heads=int(r.req("linear_num_value_heads")),
            linear_key_head_dim=int(r.req("linear_key_head_dim")),
            linear_value_head_dim=int(r.req("linear_value_head_dim")),
            linear_conv_kernel_dim=kernel, moe=moe, hf_weight_prefix=prefix,
        )
        r.finish()
        try:
            out = Qwen3_5ModelArgs(**args)
            out.check()
        except ValueError as e:
            raise UnsupportedHFConfig(f"{where}: {e}") from e
        return out
