"""Gated softmax attention (Qwen3-Next / Qwen3.5 full-attention layers): grouped-query attention with QK-norm,
partial RoPE and a sigmoid output gate.

    x ─▶ wq ─▶ per head [query | gate] ─▶ q_norm(query), RoPE on the first rotary_dim dims
    x ─▶ wk ─▶ k_norm, RoPE;  x ─▶ wv
    softmax attention (inner_attention) ─▶ x sigmoid(gate) ─▶ wo

The norms are zero-centred RMSNorms (out = norm(x) * (1 + w), w initialised to 0), as in the checkpoints.
`wq` keeps Hugging Face's layout (each head's query then its gate), so a column-wise TP split gives a rank
whole heads of both.
"""

import torch
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.rope import apply_rope_half


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight (weight starts at 0), computed in float32 and cast back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """`args` needs dim, n_heads, n_kv_heads, head_dim, norm_eps and rotary_dim (the RoPE table's width)."""

    def __init__(self, args):
        super().__init__()
        self.head_dim = args.head_dim
        self.rotary_dim = args.rotary_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * 2, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps)
        self.inner_attention = ScaledDotProductAttention()

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.wo.weight, out_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def _rope(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == x.shape[-1]:
            return apply_rope_half(x, rope)
        return torch.cat([apply_rope_half(x[..., :r], rope), x[..., r:]], dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        rope = rope_cache[positions] if positions is not None else rope_cache[:seqlen]
        # Head counts from the (possibly TP-local) projection widths, hence -1.
        q, gate = self.wq(x).view(bs, seqlen, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self._rope(self.q_norm(q), rope)
        k = self._rope(self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim)), rope)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        out = out.transpose(1, 2).reshape(bs, seqlen, -1) * torch.sigmoid(gate.reshape(bs, seqlen, -1))
        return self.wo(out)
