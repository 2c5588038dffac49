"""Multi-token prediction (MTP), DeepSeek-V3 (arXiv 2412.19437, section 2.2), usable by any family.

D sequential depths. Depth k (1..D) predicts, at position i, the token k+1 positions ahead (t_{i+k+1}):

    h^k_i = Block_k( eh_proj_k [ enorm_k(Emb(t_{i+k})) ; hnorm_k(h^{k-1}_i) ] )
    P^k_i = OutHead( norm_k(h^k_i) )

h^0 is the main model's final hidden state (after its final norm: what the output head reads), Emb and
OutHead are the main model's embedding and output projection (shared, not copied). The paper writes the
concatenation as [hnorm(h); enorm(e)]; the published checkpoints (and the inference code that runs them)
put the embedding half first, so eh_proj's columns here follow the checkpoints.

Within a window of S tokens depth k has targets for the positions i <= S-1-k only: Emb(t_{i+k}) is the
embedding sequence shifted left by k, its target the label sequence shifted left by k (`shift_left`);
the last k positions see a zero embedding and are not trained (the block is causal, so they do not reach
the trained positions). The loss (components/loss.py `token_and_mtp_loss`) is lambda/D * sum_k CE_k,
each CE_k summed over depth k's targets and divided, like the main loss, by the main loss's token count T,
as the paper's L^k_MTP = -1/T sum_i log P^k_i.

The module runs where the output head is: the last pipeline stage. A family passes the embeddings of its
input tokens down the pipeline beside the hidden state (see models/common/moe_transformer.py).
"""

from collections.abc import Callable

import torch
from torch import nn


def shift_left(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """x [B, S, ...] moved k positions towards the start along dim 1 (x[:, i] = x[:, i + k]), the last k
    positions set to `fill`."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat((x[:, k:], pad), dim=1)


class MTPDepth(nn.Module):
    """One prediction depth: the two input norms, the projection of their concatenation, a transformer
    block of the family, and the norm before the shared output head (HF: shared_head.norm)."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module):
        super().__init__()
        self.enorm = nn.RMSNorm(dim, eps=norm_eps)
        self.hnorm = nn.RMSNorm(dim, eps=norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(dim, eps=norm_eps)

    def combine(self, h: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat((self.enorm(embeddings), self.hnorm(h)), dim=-1))


class MultiTokenPrediction(nn.Module):
    """D `MTPDepth`s. `blocks` are the family's transformer blocks, one per depth (built like its own
    layers; DeepSeek-V3 numbers them after the main layers, so they are MoE blocks)."""

    def __init__(self, dim: int, norm_eps: float, blocks: list[nn.Module]):
        super().__init__()
        self.depths = nn.ModuleList(MTPDepth(dim, norm_eps, b) for b in blocks)

    def init_weights(self, init_block: Callable[[nn.Module], None], proj_std: float = 0.02) -> None:
        """Norms to ones, eh_proj ~ N(0, proj_std) truncated at 3 std, each block by `init_block`."""
        for d in self.depths:
            for norm in (d.enorm, d.hnorm, d.norm):
                norm.reset_parameters()
            nn.init.trunc_normal_(d.eh_proj.weight, mean=0.0, std=proj_std, a=-3 * proj_std, b=3 * proj_std)
            init_block(d.block)

    def forward(
        self,
        h: torch.Tensor,
        embeddings: torch.Tensor,
        output: Callable[[torch.Tensor], torch.Tensor],
        run_block: Callable[[int, nn.Module, torch.Tensor], torch.Tensor],
    ) -> list[torch.Tensor]:
        """Logits of each depth, [B, S, V] each (depth k's position i predicts t_{i+k+1}).

        h: the main model's final hidden state (after its final norm) [B, S, dim]; embeddings: the
        embeddings of the window's input tokens [B, S, dim]; output: the shared output head; run_block(k,
        block, x): how the family calls depth k's block on a hidden state (its positions, masks, RoPE
        table, MoE statistics)."""
        logits = []
        for k, depth in enumerate(self.depths, start=1):
            h = run_block(k, depth.block, depth.combine(h, shift_left(embeddings, k)))
            logits.append(output(depth.norm(h)))
        return logits
