"""The MoE layer: route each token to its top-k experts, run them, combine, add the shared experts.

    tokens ─▶ router (scores, + balancing bias for the choice) ─▶ sort token copies by expert
    ─▶ dispatch ─▶ experts ─▶ combine ─▶ x routed weight ─▶ scatter-add per token ─▶ + shared experts

Dispatch is capacity-free: every token copy reaches its expert, however unbalanced the routing. Without
expert parallel the dispatch is the identity; `distributed.expert_parallel.apply_ep` replaces it with an
all-to-all over the ep ranks (`token_dispatch`), the way context parallel swaps the attention kernel.

Under expert tensor parallel (TP with EP 1) each tp rank holds a slice of every expert's hidden units:
`expert_tp` (set by distributed.expert_parallel's tensor-parallel plan) gathers the tp ranks' routed tokens
after the router and reduce-scatters the experts' partial sums after the combine; the router still runs on
this rank's sequence shard.
"""

import dataclasses
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.components.moe.args import MoEArgs
from torchtitan.components.moe.experts import ClampedSwiGLUExperts, GroupedExperts
from torchtitan.components.moe.router import TokenChoiceRouter
from torchtitan.protocols.model import is_shape_only_forward

# (tokens sorted by expert [N, dim], this rank's token count per expert [E], experts) -> outputs [N, dim]
TokenDispatch = Callable[[torch.Tensor, torch.Tensor, GroupedExperts], torch.Tensor]


class ExpertTokens(Protocol):
    """Where the experts' tokens come from and their outputs go, when that is not this rank's own sequence shard
    (expert tensor parallel: distributed.expert_parallel.ExpertTensorParallel)."""

    def gather(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [B, S, dim], routed weights [B x S, top_k], expert ids [B x S, top_k]) of this rank's shard ->
        the same for every token the experts see here."""
        ...

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        """The MoE output [B, S', dim] over the gathered tokens (this rank's part) -> this rank's shard's output."""
        ...


def local_dispatch(x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    return experts(x, counts)


@dataclasses.dataclass
class MoEOutput:
    out: torch.Tensor
    aux_loss: torch.Tensor | None
    """Sequence-wise balance loss as a SUM over this call's tokens (see MoE.sequence_aux_loss); None when off."""
    load: torch.Tensor
    """Token copies routed to each expert by this call [E] (detached)."""
    router_probs: torch.Tensor | None = None
    """Sum over this call's tokens of each expert's router probability [E] fp32, for RouterBalance; None
    unless router_aux_loss_coef is on (in training)."""


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        for w, std in ((self.w1, 0.02), (self.w2, out_std), (self.w3, out_std)):
            nn.init.trunc_normal_(w.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.router = TokenChoiceRouter(dim, args)
        self.experts: GroupedExperts | ClampedSwiGLUExperts = (
            GroupedExperts(dim, args.hidden_dim, args.num_experts) if args.experts == "swiglu"
            else ClampedSwiGLUExperts(dim, args.hidden_dim, args.num_experts, args.swiglu_alpha, args.swiglu_limit)
        )
        shared_hidden = args.shared_hidden_dim or args.hidden_dim * args.num_shared_experts
        self.shared_experts = SwiGLU(dim, shared_hidden) if args.num_shared_experts > 0 else None
        # Qwen3.5-MoE: sigmoid(gate(x)) scales the shared experts' output token by token.
        self.shared_gate = nn.Linear(dim, 1, bias=False) if args.shared_gate and self.shared_experts else None
        # Added to the router scores when choosing experts; moved by update_expert_bias. Persistent: it is
        # part of the trained model (HF: e_score_correction_bias).
        self.register_buffer("expert_bias", torch.zeros(args.num_experts), persistent=True)
        # Token copies each expert received since the last optimizer step, on this rank.
        self.register_buffer("tokens_per_expert", torch.zeros(args.num_experts), persistent=False)
        self.token_dispatch: TokenDispatch = local_dispatch
        self.expert_tp: ExpertTokens | None = None

    def active_params_per_token(self) -> int:
        """Weights each token multiplies: the router, the shared experts and top_k routed experts (the
        pipeline's balanced split weighs stages by this; distributed.balance.module_flops)."""
        one_expert = sum(w[0].numel() for w in self.experts.parameters())  # every expert tensor is [E, ...]
        shared = 0 if self.shared_experts is None else sum(p.numel() for p in self.shared_experts.parameters())
        if self.shared_gate is not None:
            shared += self.shared_gate.weight.numel()
        router = sum(p.numel() for p in self.router.gate.parameters())
        return router + shared + self.args.top_k * one_expert

    def init_weights(self, out_std: float, buffer_device: torch.device | None = None) -> None:
        self.router.init_weights(0.02)
        self.experts.init_weights(out_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(out_std)
        if self.shared_gate is not None:
            nn.init.trunc_normal_(self.shared_gate.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
        with torch.no_grad():
            device = buffer_device or self.expert_bias.device
            self.expert_bias = torch.zeros(self.args.num_experts, device=device)
            self.tokens_per_expert = torch.zeros(self.args.num_experts, device=device)

    def forward(self, x: torch.Tensor) -> MoEOutput:
        """x [B, S, dim] (under TP + sequence parallel: this rank's sequence shard)."""
        bs, slen, dim = x.shape
        tokens = x.reshape(-1, dim)
        weights, ids, scores = self.router(tokens, self.expert_bias)
        load = self._count(ids)
        # The load is counted towards the bias update by add_layer_stats, in the model's forward: outside the
        # block, so neither an activation-checkpoint recompute nor a compiled graph sees the side effect.
        aux = None
        if self.args.aux_loss_alpha > 0 and self.training:
            aux = self.sequence_aux_loss(scores.view(bs, slen, -1), ids.view(bs, slen, -1))
        probs = scores.sum(0) if self.args.router_aux_loss_coef > 0 and self.training else None
        counts = load
        if self.expert_tp is not None:  # the experts' tokens: every tp rank's, routed where they were
            x, weights, ids = self.expert_tp.gather(x, weights, ids)
            tokens, counts = x.reshape(-1, dim), self._count(ids)
        order = ids.flatten().argsort(stable=True)
        token_of = order // self.args.top_k
        routed = self.token_dispatch(tokens[token_of], counts, self.experts)
        # Under autocast (default precision on one rank) the experts' matmuls return bf16 while the tokens
        # stay fp32: the weighted sum is taken in the tokens' dtype.
        routed = routed.to(tokens.dtype) * weights.flatten()[order].unsqueeze(-1).to(tokens.dtype)
        out = torch.zeros_like(tokens).index_add_(0, token_of, routed)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared.reshape(-1, dim)
        out = out.view(x.shape)
        if self.expert_tp is not None:
            out = self.expert_tp.reduce(out)
        return MoEOutput(out, aux, load.detach(), probs)

    def _count(self, ids: torch.Tensor) -> torch.Tensor:
        """Token copies per expert [E] int64 of expert ids [T, top_k]. Not bincount: its length depends on the
        largest id, which a compiled graph cannot know."""
        flat = ids.flatten()
        return torch.zeros(self.args.num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
            0, flat, torch.ones_like(flat))

    def sequence_aux_loss(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, alpha * sum_i f_i P_i per sequence, where f_i is expert
        i's share of the sequence's token copies times E / top_k (1 when balanced) and P_i its mean
        normalised score. Returned as a SUM over tokens (each token carries its sequence's loss), the units
        of ModelOutput.aux_loss, so dividing by the token count gives the mean over sequences.
        scores [B, S, E], ids [B, S, top_k]; under CP/TP, S is this rank's slice of each sequence."""
        a = self.args
        bs, slen, n_exp = scores.shape
        picked = torch.zeros(bs, n_exp, device=scores.device).scatter_add_(
            1, ids.reshape(bs, -1), torch.ones(bs, slen * a.top_k, device=scores.device)
        )
        f = picked * n_exp / (a.top_k * slen)
        p = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return a.aux_loss_alpha * (f * p).sum() * slen


def add_layer_stats(
    aux_total: torch.Tensor | None, metrics: dict[str, torch.Tensor], layer: str, out: MoEOutput, moe: MoE
) -> torch.Tensor | None:
    """Adds one MoE layer's balance loss to the model's total and its load imbalance (max / mean token
    copies per expert, 1 = balanced) to the model's metrics, counts its load in `moe.tokens_per_expert` (the
    next bias update's input); returns the new total.

    Called by the model's forward between blocks, never inside one: a block runs again in backward under
    activation checkpointing and is one traced graph under compile, where a side effect would count twice or
    need an autograd-state check that dynamo cannot trace. A pipeline stage's shape inference does not count."""
    if not is_shape_only_forward():
        moe.tokens_per_expert.add_(out.load)
    metrics[f"moe_load_max_over_mean/layer{layer}"] = out.load.max() / out.load.float().mean()
    if out.aux_loss is None:
        return aux_total
    return out.aux_loss if aux_total is None else aux_total + out.aux_loss


class RouterBalance:
    """transformers' load-balancing loss (`load_balancing_loss_func`, Switch Transformer's eqs. 4-6) as
    Qwen3-MoE, GPT-OSS and Mixtral add it with `output_router_logits`: over the token rows of EVERY MoE layer
    of one forward taken together (not per layer),

        loss = coef * E * sum_e f_e P_e,  f_e = top-k picks of expert e / rows,  P_e = sum of its probability / rows

    (f sums to top_k). A family's forward makes one, `add`s each MoE layer's output between blocks, and
    `add_to` its aux-loss total at the end. transformers adds coef * loss to the MEAN token loss of the
    forward; ModelOutput.aux_loss is a SUM over tokens, so it is returned times the forward's tokens (one
    layer's rows): divided by the step's token count it is transformers' value for one microbatch, and the
    token-weighted mean of the microbatches' values for several. Under TP/CP each rank's router sees its
    sequence shard, so its f and P are those of the shard."""

    def __init__(self) -> None:
        self.picks: torch.Tensor | None = None
        self.probs: torch.Tensor | None = None
        self.rows, self.layers, self.coef = 0, 0, 0.0

    def add(self, out: MoEOutput, moe: MoE) -> None:
        if out.router_probs is None:
            return
        self.picks = out.load.float() if self.picks is None else self.picks + out.load.float()
        self.probs = out.router_probs if self.probs is None else self.probs + out.router_probs
        self.rows += out.out.shape[0] * out.out.shape[1]  # this call's tokens: [B, S, dim]
        self.layers += 1
        self.coef = moe.args.router_aux_loss_coef

    def loss(self) -> torch.Tensor | None:
        """coef * transformers' loss value (the value added to a mean token loss); None when off."""
        if self.probs is None:
            return None
        n_experts = self.probs.numel()
        return self.coef * n_experts * ((self.picks / self.rows) * (self.probs / self.rows)).sum()

    def add_to(self, aux_total: torch.Tensor | None) -> torch.Tensor | None:
        loss = self.loss()
        if loss is None:
            return aux_total
        loss = loss * (self.rows // self.layers)  # in ModelOutput.aux_loss's units: a sum over the tokens
        return loss if aux_total is None else aux_total + loss
