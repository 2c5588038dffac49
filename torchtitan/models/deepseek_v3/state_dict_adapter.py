"""Conversion between our DeepSeek-V3 state dict / args and the Hugging Face `DeepseekV3ForCausalLM` layout
(the published safetensors: per-expert tensors, `kv_a_proj_with_mqa`, `e_score_correction_bias`).

No permutation is needed: DeepSeek's checkpoints rotate adjacent pairs of the rope part (HF
`rope_interleave`), as our RoPE does. The published 671B checkpoint stores most weights as fp8 with
128x128 block scales (`weight_scale_inv`); those folders are refused: dequantise them to bf16 first.

Multi-token prediction: the checkpoint stores MTP depth k as layer num_hidden_layers + k - 1 (its
`num_nextn_predict_layers` is our mtp_depth): a decoder layer's weights plus `enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, and copies of the shared embedding (`embed_tokens`) and output head
(`shared_head.head`). Ours are `mtp.depths.{k-1}.*`; the copies are written from our one embedding and
output (HFLayout.copies) and not read back. A job with mtp_depth 0 skips a folder's MTP layers. A folder
whose config counts MTP layers its weights lack (transformers' save_pretrained drops them; its config
default is 1) reads as mtp_depth 0.
"""

import dataclasses
import json
import math
import os
import re

import torch

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, yarn_mscale
from torchtitan.components.moe import MoEArgs
from torchtitan.components.moe.hf_experts import is_expert_key, stack_experts, unstack_experts
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig, rope_dict
from torchtitan.protocols.state_dict_adapter import HFLayout, StateDictAdapter

_LAYER_KEYS = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
}
_TOP_KEYS = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_FROM_HF = {v: k for k, v in _LAYER_KEYS.items()}
_TOP_FROM_HF = {v: k for k, v in _TOP_KEYS.items()}
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_HF_EXPERTS_PREFIX = re.compile(r"model\.layers\.(\d+)\.mlp\.experts")
# An MTP depth's own tensors (besides its block's), ours -> the HF layer's.
_MTP_KEYS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
_MTP_FROM_HF = {v: k for k, v in _MTP_KEYS.items()}
# The HF MTP layer's copies of the shared tensors, by the shared tensor's name.
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_OURS_MTP = re.compile(r"mtp\.depths\.(\d+)\.(.+)")

FP8_MESSAGE = (
    "this DeepSeek checkpoint is fp8 block-quantised (weight_scale_inv / quantization_config); dequantise it "
    "to bf16 first (e.g. DeepSeek-V3's inference/fp8_cast_bf16.py) and point at the bf16 folder"
)


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    args: DeepSeekV3ModelArgs
    HF_MODEL_TYPES = ("deepseek_v3",)
    # A job may drop a folder's MTP layers (mtp_depth 0) and still load the rest.
    HF_CONFIG_NOT_COMPARED = StateDictAdapter.HF_CONFIG_NOT_COMPARED | {"num_nextn_predict_layers"}

    @staticmethod
    def to_hf_config(args: DeepSeekV3ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        return to_hf_config(args, dtype)

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> DeepSeekV3ModelArgs:
        return from_hf_config(config, where)

    @classmethod
    def args_from_hf(cls, folder: str) -> DeepSeekV3ModelArgs:
        """The config's args, with mtp_depth the number of MTP layers the folder's weights hold."""
        args = super().args_from_hf(folder)
        keys = _stored_keys(folder) if args.mtp_depth else None
        if keys is None:
            return args
        held = 0
        while held < args.mtp_depth and f"model.layers.{args.n_layers + held}.eh_proj.weight" in keys:
            held += 1
        return dataclasses.replace(args, mtp_depth=held)

    def _mtp_layers(self) -> range:
        return range(self.args.n_layers, self.args.n_layers + self.args.mtp_depth)

    def hf_layout(self, key: str, shape: torch.Size) -> HFLayout | None:
        if key in _MTP_COPIES and self.args.mtp_depth:
            return HFLayout([_TOP_KEYS[key]], copies=tuple(
                f"model.layers.{i}.{_MTP_COPIES[key]}" for i in self._mtp_layers()))
        return super().hf_layout(key, shape)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = {}
        for key, t in state_dict.items():
            if m := _OURS_MTP.fullmatch(key):  # as a layer numbered after the main ones
                i, rest = self.args.n_layers + int(m.group(1)), m.group(2)
                if rest in _MTP_KEYS:
                    hf[f"model.layers.{i}.{_MTP_KEYS[rest]}"] = t
                    continue
                key = f"layers.{i}.{rest.removeprefix('block.')}"
            if key in _TOP_KEYS:
                hf[_TOP_KEYS[key]] = t
                if key in _MTP_COPIES:
                    hf.update({f"model.layers.{i}.{_MTP_COPIES[key]}": t for i in self._mtp_layers()})
            elif m := _OURS_EXPERTS.fullmatch(key):
                hf.update(unstack_experts(f"model.layers.{m.group(1)}.mlp.experts", m.group(2), t))
            elif (m := _OURS_LAYER.fullmatch(key)) and m.group(2) in _LAYER_KEYS:
                hf[f"model.layers.{m.group(1)}.{_LAYER_KEYS[m.group(2)]}"] = t
            else:
                raise KeyError(f"no Hugging Face name for {key!r}")
        return hf

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if any(k.endswith("weight_scale_inv") for k in hf_state_dict):
            raise ValueError(FP8_MESSAGE)
        n_layers, n_mtp = self.args.n_layers, self.args.mtp_depth
        copies = set(_MTP_COPIES.values())
        hf = {}
        for key, t in hf_state_dict.items():
            m = _HF_LAYER.fullmatch(key)
            if m and (int(m.group(1)) >= n_layers + n_mtp or int(m.group(1)) >= n_layers and m.group(2) in copies):
                continue  # MTP layers this job does not train; the MTP layers' copies of the shared tensors
            hf[key] = t
        ours = {}
        for (prefix, w), t in stack_experts(hf).items():
            ours[_ours_layer(int(_HF_EXPERTS_PREFIX.fullmatch(prefix).group(1)), n_layers, f"moe.experts.{w}")] = t
        for key, t in hf.items():
            if is_expert_key(key):
                continue
            m = _HF_LAYER.fullmatch(key)
            if key in _TOP_FROM_HF:
                ours[_TOP_FROM_HF[key]] = t
            elif m and int(m.group(1)) >= n_layers and m.group(2) in _MTP_FROM_HF:
                ours[f"mtp.depths.{int(m.group(1)) - n_layers}.{_MTP_FROM_HF[m.group(2)]}"] = t
            elif m and m.group(2) in _FROM_HF:
                ours[_ours_layer(int(m.group(1)), n_layers, _FROM_HF[m.group(2)])] = t
            elif not key.endswith("rotary_emb.inv_freq"):
                raise KeyError(f"unsupported Hugging Face weight {key!r}")
        return ours


def _stored_keys(folder: str) -> set[str] | None:
    """The tensor names of an HF folder's weights (from its index, else its single file's header); None
    when the path holds no weights (a config.json alone)."""
    from safetensors import safe_open

    from torchtitan.components.checkpoint.hf_folder import INDEX, SINGLE

    index, single = os.path.join(folder, INDEX), os.path.join(folder, SINGLE)
    if os.path.isfile(index):
        with open(index) as f:
            return set(json.load(f).get("weight_map", {}))
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return set(f.keys())
    return None


def _ours_layer(i: int, n_layers: int, rest: str) -> str:
    """Our name of a tensor of HF decoder layer i: a main block's, or the block of MTP depth i - n_layers + 1."""
    return f"layers.{i}.{rest}" if i < n_layers else f"mtp.depths.{i - n_layers}.block.{rest}"


def to_hf_config(args: DeepSeekV3ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
    m = args.moe
    if m.score_func != "sigmoid":
        raise ValueError(
            "Hugging Face's DeepseekV3 routes with sigmoid scores; this flavor routes with softmax (DeepSeek-V2 "
            "style), so it has no DeepseekV3 equivalent"
        )
    rope = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_factor > 1:
        rope = {
            "rope_type": "yarn", "rope_theta": args.rope_theta, "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len, "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow, "mscale": args.mscale, "mscale_all_dim": args.mscale_all_dim,
        }
        if not (args.mscale and args.mscale_all_dim):  # transformers would not take their ratio: say it
            rope["attention_factor"] = yarn_mscale(args.rope_factor, args.mscale) / yarn_mscale(
                args.rope_factor, args.mscale_all_dim
            )
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": m.num_experts,
        "n_shared_experts": m.num_shared_experts,
        "num_experts_per_tok": m.top_k,
        "n_group": m.n_groups,
        "topk_group": m.topk_groups,
        "norm_topk_prob": m.route_norm,
        "routed_scaling_factor": m.route_scale,
        "scoring_func": "sigmoid",
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope,
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": args.mtp_depth,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _yarn_mscales(rope: HFConfigReader, factor: float) -> dict:
    """(mscale, mscale_all_dim) reproducing transformers' YaRN. transformers reads a missing mscale_all_dim as
    0, which leaves the softmax scale alone, and takes the rope table's attention factor from
    `attention_factor` when given, else mscale/mscale_all_dim's ratio when both are non-zero, else
    yarn_mscale(factor, 1). Our table's factor is always yarn_mscale(factor, mscale) / yarn_mscale(factor,
    mscale_all_dim), linear in mscale, so the other cases solve for the mscale giving the same factor."""
    mscale, all_dim = rope.opt("mscale"), float(rope.opt("mscale_all_dim", 0.0))
    attention_factor = rope.opt("attention_factor")
    if attention_factor is None and mscale and all_dim:
        return {"mscale": float(mscale), "mscale_all_dim": all_dim}
    if factor <= 1:
        return {"mscale": 1.0, "mscale_all_dim": all_dim}
    target = yarn_mscale(factor, 1.0) if attention_factor is None else float(attention_factor)
    return {"mscale": (target * yarn_mscale(factor, all_dim) - 1.0) / (0.1 * math.log(factor)), "mscale_all_dim": all_dim}


def from_hf_config(config: dict, where: str = "config.json") -> DeepSeekV3ModelArgs:
    """Args of an HF DeepSeek-V3 config (either rope spelling: `rope_parameters`, or the published
    `rope_scaling` + `rope_theta`); every key is read or refused (protocols/hf_config.py). fp8-quantised
    checkpoints are refused (see FP8_MESSAGE)."""
    r = HFConfigReader(config, where, "DeepSeek-V3 (--model.name deepseek_v3)")
    if r.opt("quantization_config"):
        raise UnsupportedHFConfig(FP8_MESSAGE)
    r.expect("scoring_func", "sigmoid", "sigmoid")
    r.expect("hidden_act", "silu", "silu")
    r.expect("attention_bias", False, False)
    r.expect("attention_dropout", 0.0, 0.0)
    r.expect("rope_interleave", True, True)
    r.expect("tie_word_embeddings", False, False)
    r.expect("moe_layer_freq", 1, 1)
    r.expect("topk_method", ("noaux_tc", "greedy", "group_limited_greedy"), "noaux_tc")
    # Derived here: kv heads are the heads (MLA), head_dim / qk_head_dim follow from the MLA sizes.
    r.ignore("num_key_value_heads", "head_dim", "qk_head_dim")
    rope = HFConfigReader(rope_dict(r), f"{where} rope parameters", r.family)
    theta = float(rope.req("rope_theta"))
    kind = rope.expect("rope_type", ("default", "yarn"), "default")
    yarn = {}
    if kind == "yarn":
        original = int(rope.req("original_max_position_embeddings"))
        factor = float(rope.opt("factor") or r.req("max_position_embeddings") / original)
        rope.expect("truncate", True, True)
        yarn = dict(
            rope_factor=factor, original_seq_len=original,
            beta_fast=float(rope.opt("beta_fast") or 32), beta_slow=float(rope.opt("beta_slow") or 1),
            **_yarn_mscales(rope, factor),
        )
    rope.finish()
    args = DeepSeekV3ModelArgs(
        vocab_size=int(r.req("vocab_size")),
        dim=int(r.req("hidden_size")),
        inter_dim=int(r.req("intermediate_size")),
        n_layers=int(r.req("num_hidden_layers")),
        n_dense_layers=int(r.opt("first_k_dense_replace", 0)),
        n_heads=int(r.req("num_attention_heads")),
        norm_eps=float(r.opt("rms_norm_eps", 1e-6)),
        moe=MoEArgs(
            num_experts=int(r.req("n_routed_experts")),
            num_shared_experts=int(r.opt("n_shared_experts", 0)),
            hidden_dim=int(r.req("moe_intermediate_size")),
            top_k=int(r.req("num_experts_per_tok")),
            score_func="sigmoid",
            route_norm=bool(r.opt("norm_topk_prob", True)),
            route_scale=float(r.opt("routed_scaling_factor", 1.0)),
            n_groups=int(r.opt("n_group", 1)),
            topk_groups=int(r.opt("topk_group", 1)),
        ),
        q_lora_rank=int(r.opt("q_lora_rank", 0)),
        kv_lora_rank=int(r.req("kv_lora_rank")),
        qk_nope_head_dim=int(r.req("qk_nope_head_dim")),
        qk_rope_head_dim=int(r.req("qk_rope_head_dim")),
        v_head_dim=int(r.req("v_head_dim")),
        max_seq_len=int(r.req("max_position_embeddings")),
        rope_theta=theta,
        mtp_depth=int(r.opt("num_nextn_predict_layers", 0)),
        **yarn,
    )
    r.finish()
    return args
