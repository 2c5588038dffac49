"""The attention kernel, as a module so that context parallel can swap it for ring attention."""

import torch
import torch.nn.functional as F
from torch import nn


class ScaledDotProductAttention(nn.Module):
    """Causal softmax attention over q [B, Hq, S, D] and k, v [B, Hkv, S, D], returning [B, Hq, S, D].

    Grouped-query attention (Hkv < Hq) is resolved here: query head h reads key/value head h // (Hq/Hkv).
    The kv heads are repeated explicitly rather than via `enable_gqa`, which not every fused backend accepts.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
