"""Conversion between our DeepSeek-V3 state dict / args and the Hugging Face `DeepseekV3ForCausalLM` layout
(the published safetensors: per-expert tensors, `kv_a_proj_with_mqa`, `e_score_correction_bias`).

No permutation is needed: DeepSeek's checkpoints rotate adjacent pairs of the rope part (HF
`rope_interleave`), as our RoPE does. The published 671B checkpoint stores most weights as fp8 with
128x128 block scales (`weight_scale_inv`); those folders are refused: dequantise them to bf16 first.
The multi-token-prediction layer a checkpoint may carry (index >= num_hidden_layers) is not trained here
and is skipped.
"""

import re

import torch

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.components.moe import MoEArgs
from torchtitan.components.moe.hf_experts import is_expert_key, stack_experts, unstack_experts
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

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

FP8_MESSAGE = (
    "this DeepSeek checkpoint is fp8 block-quantised (weight_scale_inv / quantization_config); dequantise it "
    "to bf16 first (e.g. DeepSeek-V3's inference/fp8_cast_bf16.py) and point at the bf16 folder"
)


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    args: DeepSeekV3ModelArgs

    @staticmethod
    def to_hf_config(args: DeepSeekV3ModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        return to_hf_config(args, dtype)

    @staticmethod
    def from_hf_config(config: dict) -> DeepSeekV3ModelArgs:
        return from_hf_config(config)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf = {}
        for key, t in state_dict.items():
            if key in _TOP_KEYS:
                hf[_TOP_KEYS[key]] = t
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
        n_layers = self.args.n_layers
        hf = {}
        for key, t in hf_state_dict.items():
            m = _HF_LAYER.fullmatch(key)
            if m and int(m.group(1)) >= n_layers:
                continue  # the multi-token-prediction layer(s)
            hf[key] = t
        ours = {}
        for (prefix, w), t in stack_experts(hf).items():
            ours[f"layers.{_HF_EXPERTS_PREFIX.fullmatch(prefix).group(1)}.moe.experts.{w}"] = t
        for key, t in hf.items():
            if is_expert_key(key):
                continue
            if key in _TOP_FROM_HF:
                ours[_TOP_FROM_HF[key]] = t
            elif (m := _HF_LAYER.fullmatch(key)) and m.group(2) in _FROM_HF:
                ours[f"layers.{m.group(1)}.{_FROM_HF[m.group(2)]}"] = t
            elif not key.endswith("rotary_emb.inv_freq"):
                raise KeyError(f"unsupported Hugging Face weight {key!r}")
        return ours


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
        "num_nextn_predict_layers": 0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def from_hf_config(config: dict) -> DeepSeekV3ModelArgs:
    """Args of an HF DeepSeek-V3 config (either rope spelling: `rope_parameters`, or the published
    `rope_scaling` + `rope_theta`). fp8-quantised checkpoints are refused (see FP8_MESSAGE)."""
    if config.get("quantization_config"):
        raise ValueError(FP8_MESSAGE)
    if config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func {config['scoring_func']!r}: DeepSeek-V3 checkpoints route with sigmoid")
    if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias"):
        raise ValueError("only silu experts without attention biases are supported")
    if not config.get("rope_interleave", True):
        raise ValueError("rope_interleave false: this model rotates adjacent pairs (DeepSeek's layout)")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"rope type {kind!r}: only default and yarn RoPE are supported")
    yarn = {}
    if kind == "yarn":
        factor = rope.get("factor") or config["max_position_embeddings"] / rope["original_max_position_embeddings"]
        yarn = dict(
            rope_factor=float(factor), original_seq_len=rope["original_max_position_embeddings"],
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 1.0), mscale_all_dim=float(rope.get("mscale_all_dim") or 1.0),
        )
    return DeepSeekV3ModelArgs(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        inter_dim=config["intermediate_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        n_heads=config["num_attention_heads"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        moe=MoEArgs(
            num_experts=config["n_routed_experts"],
            num_shared_experts=config.get("n_shared_experts") or 0,
            hidden_dim=config["moe_intermediate_size"],
            top_k=config["num_experts_per_tok"],
            score_func="sigmoid",
            route_norm=bool(config.get("norm_topk_prob", True)),
            route_scale=float(config.get("routed_scaling_factor", 1.0)),
            n_groups=config.get("n_group") or 1,
            topk_groups=config.get("topk_group") or 1,
        ),
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=theta,
        **yarn,
    )
