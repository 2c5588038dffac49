"""The gated delta rule (Gated DeltaNet's linear attention): a chunked form for training, a recurrent form for
generation, both with an initial state in, the final state out and document resets.

Per value head, with a state S of shape [dk, dv], a decay a_t = exp(g_t) (g_t <= 0) and a write strength b_t:

    S_t = a_t S_{t-1} + k_t u_t^T,   u_t = b_t (v_t - (a_t S_{t-1})^T k_t)      (the delta rule's correction)
    o_t = S_t^T q_t

q and k are expected L2-normalised already, and q is scaled by `scale` (default dk**-0.5) here. k heads may be
fewer than v heads (grouped): v head h reads k head h // (Hv / Hk), as transformers' Qwen3.5 does.

Chunked (WY) form. Inside a chunk of C tokens starting from a state S0, with cumulative decays c_t = sum g
over the chunk up to t, the corrections solve a unit lower-triangular system:

    (I + L) U = b*V - diag(b e^c) K S0,     L_tj = b_t (k_t . k_j) e^(c_t - c_j)  for j < t

so U = T (b V) - T (b e^c K) S0 with T = (I + L)^-1 (two triangular solves per chunk, all chunks at once), and

    O  = e^c Q S0 + ((Q K^T) * e^(c_t - c_j), j <= t) U,      S_C = e^(c_C) S0 + (e^(c_C - c) K)^T U.

Only the last two lines run chunk after chunk (a loop over S/C chunks of [C, dk] x [dk, dv] matmuls), so work
and memory are linear in the sequence; the intra-chunk tensors are [S/C, C, C] per head.

Document resets (`resets` [B, S] bool, True where a document starts): the state is zero just before such a
token, exactly as if each document ran alone. In the chunked form that is a mask: pairs (t, j) of different
documents get no decay term, a token reads the incoming state only while no reset lies between the chunk
start and itself, and the outgoing state keeps only the last document's writes.

Everything is computed in float32 (like transformers' torch path; float64 inputs in float64), returned in the
dtype of v; the final state in the compute dtype.
"""

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA / transformers convention: eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta, scale):
    """[B, S, H, D] inputs -> float32 [B, Hv, S, D] (k heads repeated to the v heads), g/beta [B, Hv, S]."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if hv != hk:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = _compute_dtype(v)
    q, k, v = (x.transpose(1, 2).to(dt) for x in (q, k, v))
    return q * scale, k, v, g.transpose(1, 2).to(dt), beta.transpose(1, 2).to(dt)


def _compute_dtype(v: torch.Tensor) -> torch.dtype:
    # float64 stays float64 (the reference tests); everything else runs in float32.
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _initial(initial_state, shape, like: torch.Tensor):
    if initial_state is None:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    return initial_state.to(like.dtype)


def _chunk_major(x: torch.Tensor, n: int, c: int, pad: int, heads: int, dt: torch.dtype) -> torch.Tensor:
    """[B, S, H, d] (or [B, S, H]) -> contiguous [N, B, Hv, C, d] (or [N, B, Hv, C]) in `dt`, k heads repeated
    to the v heads. Chunk-major and contiguous on purpose: chunk i is one contiguous [B, Hv, C, d] block, so the
    scan's matmuls read it in place, and the intra-chunk matmuls see one flat batch [N*B*Hv, C, d], which
    batched matmul reads (transposed operands included) without the copies a strided batch would cost."""
    x = x.to(dt)
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.view(x.shape[0], n, c, *x.shape[2:]).transpose(0, 1).transpose(2, 3)  # [N, B, H, C, (d)]
    if x.shape[2] != heads:
        return x.repeat_interleave(heads // x.shape[2], dim=2)  # a contiguous copy
    return x.contiguous()


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, S, Hk, dk]; v [B, S, Hv, dv]; g (log decay, <= 0), beta [B, S, Hv]; initial_state
    [B, Hv, dk, dv] (zeros when None); resets [B, S] bool (document starts). Returns (o [B, S, Hv, dv] in v's
    dtype, final state [B, Hv, dk, dv] float32).

    What it keeps for backward, per token and value head (float32 elements; planning/memory.py counts the
    same): q, k, k*beta, the decayed query reads and the decayed keys of the state write (dk each), v, the
    corrections U and the outputs (dv each), the solved [U0 | W] (dv + dk); five C-wide rows (the pairwise
    decays, k k^T, the triangular system, q k^T, the masked scores); one [dk, dv] state per chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v.dtype
    bsz, seq, hv, dv = v.shape
    hk, dk = k.shape[2], k.shape[3]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    dt = _compute_dtype(v)
    scale = dk**-0.5 if scale is None else scale
    c = chunk_size
    pad = (-seq) % c
    n = (seq + pad) // c
    # Padded tokens have beta 0 (no write) and g 0 (no decay): they leave the state as it was.
    q, k, v, g, beta = (_chunk_major(x, n, c, pad, hv, dt) for x in (q, k, v, g, beta))

    cum = g.cumsum(-1)  # [N, B, H, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if resets is None:
        visible = causal  # (t, j): j <= t
        reads_in = None
    else:
        seg = F.pad(resets, (0, pad)).view(bsz, n, c).transpose(0, 1).unsqueeze(2).long().cumsum(-1)
        visible = causal & (seg.unsqueeze(-1) == seg.unsqueeze(-2))  # same document
        reads_in = (seg == 0).to(q.dtype)  # no reset between the chunk start and the token
    # e^(c_t - c_j) on visible pairs, 0 elsewhere (masked before exp, so no overflow on the upper triangle).
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~visible, float("-inf")).exp()
    gamma = cum.exp() if reads_in is None else cum.exp() * reads_in  # how much of S0 token t still sees

    flat = (n * bsz * hv, c)
    kb = k * beta.unsqueeze(-1)
    kt = k.view(*flat, dk).transpose(-1, -2)
    lower = torch.bmm(kb.view(*flat, dk), kt).view_as(decay) * decay  # diagonal ignored (unitriangular)
    # One solve for both right-hand sides: T (b V) and T (b e^c K).
    rhs = torch.cat([v * beta.unsqueeze(-1), kb * gamma.unsqueeze(-1)], dim=-1)
    u0w = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    u0, w = u0w[..., :dv], u0w[..., dv:]
    # Scaled out of place: op-level AC caches the bmm's output, and an in-place mul_ on it fails the recompute.
    attn = torch.bmm(q.view(*flat, dk), kt).mul(scale).view_as(decay) * decay
    qg = q * (gamma * scale).unsqueeze(-1)  # the queries' read of the incoming state
    # What the chunk's last token keeps of each write ([dk, C] per chunk), and of the incoming state.
    k_out = (k * decay[..., -1, :].unsqueeze(-1)).transpose(-1, -2)
    keep = gamma[..., -1:].unsqueeze(-1)  # [N, B, H, 1, 1]

    state = _initial(initial_state, (bsz, hv, dk, dv), q)
    outs = []
    for i in range(n):
        u = u0[i] - w[i] @ state
        outs.append(qg[i] @ state + attn[i] @ u)
        state = keep[i] * state + k_out[i] @ u
    o = torch.stack(outs, dim=2).view(bsz, hv, n * c, dv)[:, :, :seq]
    return o.transpose(1, 2).to(out_dtype), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same function token by token (generation: one step per new token, the state carried over).
    Arguments and results as `chunk_gated_delta_rule`."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)
    bsz, hv, seq, dv = v.shape
    state = _initial(initial_state, (bsz, hv, k.shape[-1], dv), q)
    outs = []
    for t in range(seq):
        a = g[:, :, t].exp()
        if resets is not None:
            a = a * (~resets[:, t]).to(a.dtype).unsqueeze(1)
        state = state * a[..., None, None]
        kt = k[:, :, t]
        u = beta[:, :, t, None] * (v[:, :, t] - (kt.unsqueeze(-1) * state).sum(-2))
        state = state + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append((q[:, :, t].unsqueeze(-1) * state).sum(-2))
    return torch.stack(outs, dim=2).transpose(1, 2).to(out_dtype), state
