"""The shape and routing of one MoE layer, and how a job balances its routers."""

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.protocols.hf_config import read_config_file

DEFAULT_LOAD_BALANCE_COEFF = 1e-3
"""--moe.load_balance_coeff when unset, for a model that does not come from a Hugging Face format without a
balancing bias (MoEConfig.load_balance_coeff)."""


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

    load_balance_coeff: float | None = None
    """Auxiliary-loss-free balancing: each optimizer step moves every expert's routing bias by this much
    towards the mean load (up when under-loaded, down when over-loaded); 0 turns it off. Unset: 1e-3, except
    for a model that comes from a Hugging Face folder (--model.hf_config, --checkpoint.initial_load_in_hf) of
    a format whose router has no balancing bias (Qwen3-MoE, Qwen3.5-MoE, GPT-OSS): there 0, and the routers
    are balanced as transformers trains that format, by its load-balancing loss with the folder's
    `router_aux_loss_coef` (unless --moe.router_aux_loss_coef is given), so the trained model exports back to
    that format (a moved bias cannot be written there). The log says which balancing a run uses and why."""

    aux_loss_alpha: float = 0.0
    """Weight of DeepSeek-V3's sequence-wise balance loss, added to the training loss (published: 1e-4);
    0 turns it off. Not available under pipeline parallel (stages pass activations only)."""

    router_aux_loss_coef: float | None = None
    """Weight of transformers' load-balancing loss (Qwen3-MoE's `router_aux_loss_coef`; softmax routing), added
    to the training loss; unset: the model's own (from its HF config, where `output_router_logits` is true,
    else 0; see load_balance_coeff for a model that comes from a Hugging Face folder); 0 turns it off. Not
    available under pipeline parallel."""


@dataclass(frozen=True)
class MoEBalancing:
    """How a job balances its routers: the `moe` section's two balancing options, resolved, and why."""

    load_balance_coeff: float
    router_aux_loss_coef: float | None
    """None: the model's own (its flavor's or HF config's)."""
    why: str
    """For the log, e.g. `no bias updates (--moe.load_balance_coeff 0) and transformers' load-balancing loss
    x 0.001: the model comes from the Hugging Face folder X, whose router has no balancing bias`."""


def hf_source_folder(job_config: Any) -> str | None:
    """The Hugging Face folder (or config.json) a job's model comes from: its shape (--model.hf_config) or
    its weights (--checkpoint.initial_load_in_hf); None when neither."""
    if job_config.model.hf_config:
        return job_config.model.hf_config
    c = job_config.checkpoint
    return c.initial_load_path if c.initial_load_in_hf and c.initial_load_path else None


def _folder_aux_loss_coef(folder: str) -> float:
    """The `router_aux_loss_coef` of a folder's config.json (a multimodal one: of its text_config); 0 when
    the folder or the key is missing (the HF-folder checks of plan_job refuse a missing folder)."""
    try:
        config = read_config_file(folder)
    except (OSError, ValueError):
        return 0.0
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    value = config.get("router_aux_loss_coef", text.get("router_aux_loss_coef", 0.0))
    return float(value) if isinstance(value, (int, float)) else 0.0


def resolve_moe_balancing(job_config: Any, hf_keeps_expert_bias: bool) -> MoEBalancing:
    """The balancing a job trains with. Set options win (--moe.load_balance_coeff on the command line or in
    the TOML: the option is None only when neither gave it). Unset, a model from a Hugging Face folder whose
    format has no slot for the balancing bias (`hf_keeps_expert_bias` False: the family's adapter) is
    balanced the way that format is trained: no bias updates, transformers' load-balancing loss with the
    folder's router_aux_loss_coef (read whatever its `output_router_logits` says: transformers' configs keep
    that off for inference, and its training recipes turn it on). Under pipeline parallel that loss cannot
    run (stages pass activations only), so the routers are then left unbalanced, exportable."""
    m = job_config.moe
    if m.load_balance_coeff is not None:
        return MoEBalancing(m.load_balance_coeff, m.router_aux_loss_coef,
                            f"--moe.load_balance_coeff {m.load_balance_coeff} as set")
    folder = hf_source_folder(job_config)
    if folder is None or hf_keeps_expert_bias:
        where = f"; the Hugging Face format of {folder} keeps the bias" if folder else ""
        return MoEBalancing(DEFAULT_LOAD_BALANCE_COEFF, m.router_aux_loss_coef,
                            f"bias updates, --moe.load_balance_coeff {DEFAULT_LOAD_BALANCE_COEFF} (the default{where})")
    because = f"the model comes from the Hugging Face folder {folder}, whose router has no balancing bias to export"
    if m.router_aux_loss_coef is not None:
        return MoEBalancing(0.0, m.router_aux_loss_coef,
                            f"no bias updates (--moe.load_balance_coeff 0) and --moe.router_aux_loss_coef "
                            f"{m.router_aux_loss_coef} as set: {because}")
    if job_config.parallelism.pipeline_parallel_degree > 1:
        return MoEBalancing(0.0, 0.0,
                            f"none: {because}, and its load-balancing loss needs the whole model in one stage "
                            f"(pipeline parallel); --moe.load_balance_coeff 1e-3 balances by the bias instead "
                            f"(then the model does not export to that format)")
    coef = _folder_aux_loss_coef(folder)
    if coef <= 0:
        return MoEBalancing(0.0, 0.0, f"none: {because}, and its config sets no router_aux_loss_coef; give "
                                      f"--moe.router_aux_loss_coef (e.g. 0.001) to balance as transformers does")
    return MoEBalancing(0.0, coef, f"no bias updates (--moe.load_balance_coeff 0) and transformers' "
                                   f"load-balancing loss x {coef} (the folder's router_aux_loss_coef): {because}")


def moe_args_for_job(moe: MoEArgs, job_config: Any) -> MoEArgs:
    """A flavor's MoE args with the job's `moe` section applied (plan_job resolves an unset
    load_balance_coeff first: resolve_moe_balancing; left unset, e.g. offline, it is the default); the
    sequence-wise loss is refused under pipeline parallel (stages pass activations only, so a middle stage's loss has no way to the loss)."""
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
    balance = DEFAULT_LOAD_BALANCE_COEFF if m.load_balance_coeff is None else m.load_balance_coeff
    return dataclasses.replace(moe, load_balance_coeff=balance, aux_loss_alpha=m.aux_loss_alpha,
                               router_aux_loss_coef=coef)
