"""Conversion between our Qwen3-MoE state dict / args and the Hugging Face `Qwen3MoeForCausalLM` layout
(the published safetensors: `mlp.gate` router, per-expert `mlp.experts.{e}.*_proj`). Attention weights are
named as in Qwen3 (no permutation: both use the half RoPE layout).

HF's Qwen3-MoE router has no balancing bias: a model whose bias moved (aux-loss-free balancing) is refused
on export, since dropping the bias would change its routing.
"""

import dataclasses
import re

import torch

from torchtitan.components.moe.args import MoEArgs
from torchtitan.components.moe.hf_experts import is_expert_key, stack_experts, unstack_experts
from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter, read_qwen3_config
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs
from torchtitan.protocols.hf_config import HFConfigReader, UnsupportedHFConfig
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

_OURS_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w[123])")
_OURS_ROUTER = re.compile(r"layers\.(\d+)\.moe\.router\.gate\.weight")
_OURS_BIAS = re.compile(r"layers\.(\d+)\.moe\.expert_bias")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")
_HF_EXPERTS_PREFIX = re.compile(r"model\.layers\.(\d+)\.mlp\.experts")


class Qwen3MoeStateDictAdapter(StateDictAdapter):
    args: Qwen3MoeModelArgs
    HF_MODEL_TYPES = ("qwen3_moe",)
    HF_KEEPS_EXPERT_BIAS = False  # the router is a plain linear
    # Training settings, not the model: a job may train a folder's weights with another balance loss weight.
    HF_CONFIG_NOT_COMPARED = StateDictAdapter.HF_CONFIG_NOT_COMPARED | {"output_router_logits", "router_aux_loss_coef"}

    def hf_layout(self, key: str, shape: torch.Size):
        if _OURS_BIAS.fullmatch(key):
            return None  # HF's router has no bias; to_hf refuses a moved one
        return super().hf_layout(key, shape)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf, rest = {}, {}
        for key, t in state_dict.items():
            if m := _OURS_EXPERTS.fullmatch(key):
                hf.update(unstack_experts(f"model.layers.{m.group(1)}.mlp.experts", m.group(2), t))
            elif m := _OURS_ROUTER.fullmatch(key):
                hf[f"model.layers.{m.group(1)}.mlp.gate.weight"] = t
            elif _OURS_BIAS.fullmatch(key):
                if t.abs().max() > 0:
                    raise ValueError(
                        f"{key} is non-zero (trained with --moe.load_balance_coeff > 0), and Hugging Face's "
                        f"Qwen3-MoE router has no bias: exporting would change the routing; train with "
                        f"--moe.load_balance_coeff 0 (and --moe.aux_loss_alpha) to export to that format"
                    )
            else:
                rest[key] = t
        return {**hf, **Qwen3StateDictAdapter(self.args).to_hf(rest)}

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ours, rest = {}, {}
        for (prefix, w), t in stack_experts(hf_state_dict).items():
            ours[f"layers.{_HF_EXPERTS_PREFIX.fullmatch(prefix).group(1)}.moe.experts.{w}"] = t
        for key, t in hf_state_dict.items():
            if is_expert_key(key):
                continue
            if m := _HF_ROUTER.fullmatch(key):
                layer = m.group(1)
                ours[f"layers.{layer}.moe.router.gate.weight"] = t
                ours[f"layers.{layer}.moe.expert_bias"] = torch.zeros(t.shape[0], dtype=torch.float32)
            else:
                rest[key] = t
        return {**ours, **Qwen3StateDictAdapter(self.args).from_hf(rest)}

    @staticmethod
    def to_hf_config(args: Qwen3MoeModelArgs, dtype: torch.dtype = torch.bfloat16) -> dict:
        m = args.moe
        if m.score_func != "softmax" or m.num_shared_experts or m.n_groups != 1 or m.route_scale != 1.0:
            raise ValueError("Hugging Face's Qwen3-MoE routes by softmax top-k without shared experts, groups or scaling")
        return {
            **Qwen3StateDictAdapter.to_hf_config(args, dtype),
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "moe_intermediate_size": m.hidden_dim,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": m.router_aux_loss_coef > 0,
            "router_aux_loss_coef": m.router_aux_loss_coef,
        }

    @staticmethod
    def from_hf_config(config: dict, where: str = "config.json") -> Qwen3MoeModelArgs:
        """Args of an HF Qwen3-MoE config (published: `num_experts`; transformers 5 writes `num_local_experts`);
        every key is read or refused (protocols/hf_config.py)."""
        r = HFConfigReader(config, where, "Qwen3-MoE (--model.name qwen3_moe)")
        if r.opt("mlp_only_layers") or r.opt("decoder_sparse_step", 1) != 1:
            raise UnsupportedHFConfig(
                f"{where}: dense blocks (mlp_only_layers / decoder_sparse_step) are not supported: every block is MoE here"
            )
        dense = read_qwen3_config(r)
        experts = r.opt("num_experts") or r.req("num_local_experts")
        r.ignore("num_experts", "num_local_experts")
        moe = MoEArgs(
            num_experts=int(experts), num_shared_experts=0, hidden_dim=int(r.req("moe_intermediate_size")),
            top_k=int(r.req("num_experts_per_tok")), score_func="softmax",
            route_norm=bool(r.opt("norm_topk_prob", False)), route_scale=1.0,
            # transformers trains with the load-balancing loss only when output_router_logits is true
            router_aux_loss_coef=float(r.opt("router_aux_loss_coef", 0.0)) if r.opt("output_router_logits") else 0.0,
        )
        r.finish()
        return Qwen3MoeModelArgs(**{f.name: getattr(dense, f.name) for f in dataclasses.fields(dense)}, moe=moe)
