"""Qwen3's attention block, shared by the Qwen3 families: grouped-query attention with QK-norm."""

import torch
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.rope import apply_rope_half as apply_rope


class QKNormAttention(nn.Module):
    """Grouped-query attention whose q and k are RMS-normalised per head before RoPE (half layout).

    `args` needs dim, n_heads, n_kv_heads, head_dim and norm_eps (Qwen3 and Qwen3-MoE args have them)."""

    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # QK-norm: one weight of head_dim shared by every head, applied per head.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.inner_attention = ScaledDotProductAttention()

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.wo.weight, out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Rows are gathered here, where the sequence is whole again (under sequence parallel the block input is
        # a sequence shard and the attention input the all-gathered sequence).
        rope = rope_cache[positions] if positions is not None else rope_cache[:seqlen]
        # Head counts come from the projections' (possibly tensor-parallel-local) widths, hence -1.
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))
