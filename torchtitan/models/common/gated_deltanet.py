"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), as a block any family can use.

    x ─▶ in_proj_q/k/v ─▶ causal depthwise conv (kernel K) + SiLU ─▶ L2-norm q, k ─┐
    x ─▶ in_proj_a ─▶ g = -exp(A_log) * softplus(a + dt_bias)      (log decay)    ├─▶ gated delta rule ─▶ o
    x ─▶ in_proj_b ─▶ beta = sigmoid(b)                             (write gate)   ┘
    o ─▶ RMSNorm per head ─▶ x silu(in_proj_z x) ─▶ out_proj

The sequence-mixing part (conv + delta rule) is one module, `inner_attention` (GatedDeltaRuleKernel), like the
softmax kernel of the other attention blocks: context parallel swaps it for its state-passing form
(distributed/linear_attention_cp.py) by its `kind`, and the block never knows which runs.

Tensor parallel splits the heads: q/k/v/z/a/b projections column-wise, the conv channels and the per-head
parameters (A_log, dt_bias) Shard(0) alike (style HEAD_PARAMS: the module computes with its local shard),
the per-head output norm's weight replicated with its gradient summed (HEAD_NORM), out_proj row-wise. q, k and
v are separate projections and convs (Hugging Face fuses them as `in_proj_qkv` / `conv1d`; the adapter splits
them) so that a column-wise split gives each rank the q, k and v of the same heads.

Document masking (`document_ids`): the recurrent state and the conv window restart at every document start.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.gated_delta_rule import chunk_gated_delta_rule, l2norm
from torchtitan.models.common.init import trunc_normal


def _local(t: torch.Tensor) -> torch.Tensor:
    # Under TP the conv and decay parameters are DTensors sharded over heads; this rank computes with its own.
    return t.to_local() if isinstance(t, DTensor) else t


def document_resets(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a token's document differs from the previous token's (the first is False)."""
    resets = torch.zeros_like(document_ids, dtype=torch.bool)
    resets[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return resets


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    prefix: torch.Tensor | None = None,
    prefix_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU(causal depthwise conv) of x [B, S, C] with weight [C, 1, K] (PyTorch's Conv1d layout): output t
    sums w[K-1-s] * x[t-s] for s < K. `prefix` [B, K-1, C]: the K-1 tokens before x (context parallel's halo;
    zeros when None). With `document_ids` [B, S] (and `prefix_ids` [B, K-1]) a token only reads tokens of its
    own document."""
    bsz, seq, ch = x.shape
    k = weight.shape[-1]
    if prefix is None:
        prefix = x.new_zeros(bsz, k - 1, ch)
    ext = torch.cat([prefix.to(x.dtype), x], dim=1)
    w = weight.to(x.dtype)
    if document_ids is None:
        out = F.conv1d(ext.transpose(1, 2), w, groups=ch).transpose(1, 2)
    else:
        if prefix_ids is None:
            prefix_ids = document_ids.new_full((bsz, k - 1), -1)
        ids = torch.cat([prefix_ids, document_ids], dim=1)
        out = torch.zeros_like(x)
        for s in range(k):
            same = (ids[:, k - 1 - s : k - 1 - s + seq] == document_ids).unsqueeze(-1).to(x.dtype)
            out = out + ext[:, k - 1 - s : k - 1 - s + seq] * w[:, 0, k - 1 - s] * same
    return F.silu(out)


class GatedDeltaRuleKernel(nn.Module):
    """conv + SiLU, L2-norm of q/k, and the chunked gated delta rule: everything that mixes tokens along the
    sequence. Context parallel wraps it (by `kind`) in a state-passing module of the same signature, which
    calls its three steps (`conv`, `heads`, `scan`) piece by piece (distributed/linear_attention_cp.py)."""

    kind = "linear_attention"

    def __init__(self, chunk_size: int = 64):
        super().__init__()
        self.chunk_size = chunk_size

    conv = staticmethod(short_conv)

    @staticmethod
    def heads(q, k, v, head_dims):
        return split_heads(q, k, v, head_dims)

    def scan(self, q, k, v, g, beta, initial_state=None, resets=None):
        """The chunked gated delta rule: (o [B, S, Hv, dv'], final state [B, Hv, dk, dv'])."""
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=self.chunk_size,
                                      initial_state=initial_state, resets=resets)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        head_dims: tuple[int, int],
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q, k [B, S, Hk*dk], v [B, S, Hv*dv] before the conv; g, beta [B, S, Hv]; conv_weights for q, k, v
        ([C, 1, K] each); head_dims (dk, dv). Returns o [B, S, Hv, dv]."""
        q, k, v = (short_conv(t, w, document_ids) for t, w in zip((q, k, v), conv_weights))
        q, k, v = split_heads(q, k, v, head_dims)
        o, _ = self.scan(q, k, v, g, beta, resets=document_resets(document_ids) if document_ids is not None else None)
        return o

    def extra_repr(self) -> str:
        return f"chunk_size={self.chunk_size}"


def split_heads(q, k, v, head_dims):
    """Conv outputs [B, S, H*d] -> heads [B, S, H, d], q and k L2-normalised (in float32, like transformers)."""
    dk, dv = head_dims
    bsz, seq = q.shape[:2]
    q = l2norm(q.float().view(bsz, seq, -1, dk))
    k = l2norm(k.float().view(bsz, seq, -1, dk))
    return q, k, v.view(bsz, seq, -1, dv)


class ShortConv(nn.Module):
    """The depthwise conv weights of q, k and v ([C, 1, K] each, no bias); applied by the kernel."""

    def __init__(self, key_dim: int, value_dim: int, kernel: int):
        super().__init__()
        self.q = nn.Parameter(torch.empty(key_dim, 1, kernel))
        self.k = nn.Parameter(torch.empty(key_dim, 1, kernel))
        self.v = nn.Parameter(torch.empty(value_dim, 1, kernel))

    def init_weights(self) -> None:
        # PyTorch's Conv1d default (kaiming uniform, fan_in = K for a depthwise conv).
        for w in (self.q, self.k, self.v):
            bound = w.shape[-1] ** -0.5
            nn.init.uniform_(w, -bound, bound)

    def local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _local(self.q), _local(self.k), _local(self.v)


class DecayGate(nn.Module):
    """Per-head log decay g = -exp(A_log) * softplus(a + dt_bias), in float32."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.dt_bias = nn.Parameter(torch.empty(num_heads))

    def init_weights(self) -> None:
        # As transformers: A uniform in [1e-2, 16] (kept away from 0 so log A is finite), dt_bias ones.
        with torch.no_grad():
            self.A_log.uniform_(0.01, 16).log_()
        nn.init.ones_(self.dt_bias)

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return -_local(self.A_log).float().exp() * F.softplus(a.float() + _local(self.dt_bias).float())


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's dv values (weight of ones), in float32 whatever the input and weight dtypes
    (under mixed precision the output is gated in float32 next)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer. `args` needs dim, norm_eps and the linear_* fields of Qwen3.5's args
    (num key/value heads, key/value head dims, conv kernel, chunk size)."""

    def __init__(self, args):
        super().__init__()
        self.head_dims = (args.linear_key_head_dim, args.linear_value_head_dim)
        key_dim = args.linear_num_key_heads * args.linear_key_head_dim
        value_dim = args.linear_num_value_heads * args.linear_value_head_dim
        hv = args.linear_num_value_heads
        self.in_proj_q = nn.Linear(args.dim, key_dim, bias=False)
        self.in_proj_k = nn.Linear(args.dim, key_dim, bias=False)
        self.in_proj_v = nn.Linear(args.dim, value_dim, bias=False)
        self.in_proj_z = nn.Linear(args.dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(args.dim, hv, bias=False)
        self.in_proj_a = nn.Linear(args.dim, hv, bias=False)
        self.conv = ShortConv(key_dim, value_dim, args.linear_conv_kernel_dim)
        self.decay = DecayGate(hv)
        # The output norm (per head over dv, weight of ones) before the SiLU(z) gate.
        self.norm = HeadRMSNorm(args.linear_value_head_dim, eps=args.norm_eps)
        self.out_proj = nn.Linear(value_dim, args.dim, bias=False)
        self.inner_attention = GatedDeltaRuleKernel(args.linear_chunk_size)

    def init_weights(self, out_std: float) -> None:
        for w in (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.out_proj.weight, out_std)
        self.conv.init_weights()
        self.decay.init_weights()
        self.norm.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The softmax attention blocks' signature (RoPE arguments unused: position comes from the recurrence),
        so one TP entry serves both kinds of block."""
        bsz, seq, _ = x.shape
        g = self.decay(self.in_proj_a(x))
        beta = torch.sigmoid(self.in_proj_b(x).float())
        o = self.inner_attention(self.in_proj_q(x), self.in_proj_k(x), self.in_proj_v(x), g, beta,
                                 self.conv.local(), self.head_dims, document_ids)
        z = self.in_proj_z(x).view(bsz, seq, -1, self.head_dims[1])
        o = (self.norm(o) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(bsz, seq, -1))
