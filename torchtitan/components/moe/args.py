"""The shape and routing of one MoE layer."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class MoEArgs:
    num_experts: int = 8
    """Routed experts."""
    num_shared_experts: int = 1
    """Shared experts every token goes through, fused into one SwiGLU of num_shared_experts x hidden_dim."""
    hidden_dim: int = 128
    """SwiGLU hidden size of each expert."""
    top_k: int = 2
    """Routed experts per token."""
    score_func: Literal["softmax", "sigmoid"] = "sigmoid"
    """Router scores: softmax over experts (DeepSeek-V2, Qwen3-MoE) or per-expert sigmoid (DeepSeek-V3)."""
    route_norm: bool = True
    """Renormalise each token's top-k scores to sum to 1 before scaling."""
    route_scale: float = 1.0
    """Multiplier of the routed weights (DeepSeek-V3: 2.5)."""
    n_groups: int = 1
    """Group-limited routing: experts form n_groups groups; a token may only pick experts from its
    topk_groups best groups (DeepSeek-V3: 8 groups, 4 of them)."""
    topk_groups: int = 1
    load_balance_coeff: float = 1e-3
    """Auxiliary-loss-free balancing: after each optimizer step every expert's routing bias moves by this
    much towards the mean load (up when under-loaded, down when over-loaded); 0 turns it off."""
    aux_loss_alpha: float = 0.0
    """Weight of the sequence-wise balance loss (DeepSeek-V3: 1e-4); 0 turns it off."""
    router_aux_loss_coef: float = 0.0
    """Weight of transformers' load-balancing loss (Switch Transformer's, as Qwen3-MoE, GPT-OSS and Mixtral
    train with `output_router_logits`; HF config `router_aux_loss_coef`): num_experts * sum_e f_e P_e over
    the tokens of every MoE layer of a forward together (components/moe/moe.py RouterBalance); softmax
    routing only; 0 turns it off."""
    shared_hidden_dim: int = 0
    """SwiGLU width of the shared experts when it is not num_shared_experts x hidden_dim (Qwen3.5-MoE's
    `shared_expert_intermediate_size`); 0 = num_shared_experts x hidden_dim."""
    shared_gate: bool = False
    """Scale the shared experts' output per token by sigmoid(a learned linear of the token) (Qwen2/3.5-MoE's
    `shared_expert_gate`)."""
    router_bias: bool = False
    """The router's gate is a linear layer with a learned bias (GPT-OSS)."""
    experts: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    """Routed experts: "swiglu" (w2(silu(w1 x) * w3 x), no biases; DeepSeek, Qwen3-MoE) or "clamped_swiglu"
    (GPT-OSS: fused interleaved gate/up and down projections with biases, components/moe/experts.py)."""
    swiglu_alpha: float = 1.702
    """clamped_swiglu: the sigmoid's gain, gate * sigmoid(alpha * gate)."""
    swiglu_limit: float = 7.0
    """clamped_swiglu: the gate is clamped above at this value, the up projection to [-limit, limit]."""

    def hidden_sizes(self) -> dict[str, int]:
        """The hidden sizes expert tensor parallel splits over tp (ParallelDims.check_model's "etp" entry): the
        routed experts' and, where there are shared experts, theirs."""
        out = {"moe.hidden_dim": self.hidden_dim}
        if self.num_shared_experts > 0:
            out["shared experts' hidden size"] = self.shared_hidden_dim or self.hidden_dim * self.num_shared_experts
        return out

    def check(self) -> None:
        if self.experts not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"experts must be swiglu or clamped_swiglu, got {self.experts!r}")
        if self.score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be softmax or sigmoid, got {self.score_func!r}")
        if self.num_experts % self.n_groups:
            raise ValueError(f"n_groups {self.n_groups} must divide num_experts {self.num_experts}")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError(f"topk_groups {self.topk_groups} must be in 1..n_groups {self.n_groups}")
        if not 1 <= self.top_k <= self.num_experts // self.n_groups * self.topk_groups:
            raise ValueError(f"top_k {self.top_k} must be in 1..experts in the chosen groups")


@dataclass
class MoEConfig:
    """The `moe` config section of MoE models (--moe.*): how routing is balanced during training."""

    load_balance_coeff: float = 1e-3
    """Auxiliary-loss-free balancing: each optimizer step moves every expert's routing bias by this much
    towards the mean load (up when under-loaded, down when over-loaded); 0 turns it off."""

    aux_loss_alpha: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, added to the training loss (published: 1e-4);
    0 turns it off. Not available under pipeline parallel (stages pass activations only)."""

    router_aux_loss_coef: float | None = None
    """Weight of transformers' load-balancing loss (Qwen3-MoE's `router_aux_loss_coef`; softmax routing), added
    to the training loss; unset: the model's own (from its HF config, where `output_router_logits` is true,
    else 0); 0 turns it off. Not available under pipeline parallel."""


def moe_args_for_job(moe: MoEArgs, job_config: Any) -> MoEArgs:
    """A flavor's MoE args with the job's `moe` section applied; the sequence-wise loss is refused under
    pipeline parallel (stages pass activations only, so a middle stage's loss has no way to the loss)."""
    m = job_config.moe
    coef = moe.router_aux_loss_coef if m.router_aux_loss_coef is None else m.router_aux_loss_coef
    for name, value in (("aux_loss_alpha", m.aux_loss_alpha), ("router_aux_loss_coef", coef)):
        if value > 0 and job_config.parallelism.pipeline_parallel_degree > 1:
            raise ValueError(
                f"--moe.{name} needs the whole model in one stage (pipeline stages pass activations only); "
                f"under pipeline parallel balance with --moe.load_balance_coeff and set --moe.{name} 0"
            )
    if coef > 0 and moe.score_func != "softmax":
        raise ValueError(
            f"--moe.router_aux_loss_coef {coef}: transformers' load-balancing loss reads softmax router "
            f"probabilities, and this model routes by {moe.score_func} scores; use --moe.aux_loss_alpha instead"
        )
    return dataclasses.replace(moe, load_balance_coeff=m.load_balance_coeff, aux_loss_alpha=m.aux_loss_alpha,
                               router_aux_loss_coef=coef)
