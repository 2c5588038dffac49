"""Token-choice top-k routing: every token picks its top_k experts (no capacity, no token dropping)."""

import torch
from torch import nn

from torchtitan.components.moe.args import MoEArgs


class TokenChoiceRouter(nn.Module):
    def __init__(self, dim: int, args: MoEArgs):
        super().__init__()
        args.check()
        self.args = args
        self.gate = nn.Linear(dim, args.num_experts, bias=args.router_bias)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.gate.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)

    def forward(
        self, x: torch.Tensor, expert_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, dim] -> (routed weights [T, top_k] fp32, expert ids [T, top_k], scores [T, E] fp32).

        The bias (aux-loss-free balancing) only steers which experts are chosen; the weights are the
        unbiased scores of the chosen experts. The scores are fp32 from the gate's output on. The gate is
        called as a module so that tensor parallel can wrap it (its tokens are a sequence shard there)."""
        a = self.args
        scores = self.gate(x).float()
        scores = scores.sigmoid() if a.score_func == "sigmoid" else scores.softmax(dim=-1)
        choice = scores if expert_bias is None else scores + expert_bias
        if a.n_groups > 1:
            grouped = choice.unflatten(-1, (a.n_groups, -1))
            # A group's strength: the sum of its best two scores for sigmoid scores (DeepSeek-V3), its
            # best score for softmax scores (DeepSeek-V2).
            strength = grouped.topk(2, dim=-1).values.sum(-1) if a.score_func == "sigmoid" else grouped.amax(-1)
            keep = torch.zeros_like(strength, dtype=torch.bool)
            keep.scatter_(1, strength.topk(a.topk_groups, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
        ids = choice.topk(a.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if a.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * a.route_scale, ids, scores
