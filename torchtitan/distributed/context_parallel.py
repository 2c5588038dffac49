"""Context parallelism: causal ring attention over a load-balanced sequence shard.

Layout. The sequence is cut into 2*cp equal chunks; rank r holds chunks r and 2*cp-1-r, concatenated in
that order. With a causal mask, chunk i attends to chunks 0..i, so pairing an early chunk with a late one
gives every rank the same amount of attention work.

Because chunks are whole, any (query chunk a, key chunk b) pair is in one of three states: fully visible
(a > b), diagonal-causal (a == b) or fully masked (a < b). Masked blocks are skipped outright; only the
diagonal block needs an element mask. With document masking every rank's document ids are all-gathered
once per attention call; a block where no query shares a document with any key is skipped as well, the
others get an element mask (same document, and causal on the diagonal).

Math. Each block yields a partial output and the log-sum-exp (lse) of its scores; partials are merged with
the online-softmax rule, so the result is exact softmax attention over all visible keys. Backward recomputes
each block's probabilities from the final (out, lse), which makes per-block gradients sum to the exact
full-attention gradients. All block math runs in fp32 with plain matmuls so it is correct on any device.

Rotation. "allgather" gathers every rank's k/v once (simple; k/v saved for backward are O(S) per rank).
"alltoall" passes k/v shards around a point-to-point ring, posting the next transfer before computing on the
current shard so communication overlaps compute; only the local O(S/cp) shard is saved, and backward rotates
k/v again while the k/v gradients travel with them and arrive home after one last hop.

Grouped-query attention is handled by viewing q as [B, Hkv, group, S, D] and broadcasting k/v over the group
dimension, so repeated k/v are never materialised nor sent.

Attention kinds (models/common/attention.py). A sliding window of W keys (key j visible to query i iff
0 <= i - j < W) skips every block whose nearest pair is W or more apart and masks the blocks it cuts. Sinks
(a learned logit per head in the softmax denominator, GPT-OSS) are counted once, after every key block is
merged: lse' = logaddexp(lse, sink) and out *= exp(lse - lse'); backward then recomputes the probabilities
from lse', and the sink's gradient is -sum_i exp(sink - lse'_i) * delta_i over this rank's queries.
"""

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

RotateMethod = Literal["allgather", "alltoall"]
_ROTATE_METHODS = ("allgather", "alltoall")


# ---------------------------------------------------------------------------------------------------------
# Sequence sharding helpers
# ---------------------------------------------------------------------------------------------------------


def _check_seq_len(seq_len: int, cp_size: int) -> int:
    """Return the chunk length, or raise a ValueError that says what would work instead."""
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    n_chunks = 2 * cp_size
    if seq_len <= 0 or seq_len % n_chunks != 0:
        lower = seq_len // n_chunks * n_chunks
        upper = lower + n_chunks
        nearest = lower if lower > 0 and seq_len - lower < upper - seq_len else upper
        raise ValueError(
            f"context parallelism with cp_size={cp_size} splits the sequence into 2*cp_size={n_chunks} "
            f"chunks, but seq_len={seq_len} is not a positive multiple of {n_chunks}; "
            f"nearest valid seq_len is {nearest}"
        )
    return seq_len // n_chunks


def _chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """Global chunk ids held by `cp_rank`, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_indices(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global sequence positions held by `cp_rank`, in the order they appear in its local shard."""
    chunk = _check_seq_len(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got {cp_rank}")
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in _chunk_ids(cp_size, cp_rank)])


def shard_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's load-balanced shard of `x` along `dim` (a copy, contiguous)."""
    index = load_balanced_indices(x.shape[dim], cp_size, cp_rank).to(x.device)
    return x.index_select(dim, index)


def shard_batch(batch: tuple, cp_rank: int, cp_size: int) -> tuple:
    """This rank's slice of [B, S] tensors that go together (inputs and labels; inputs may be a dict of
    tensors such as tokens and document ids): the same load-balanced positions of each, so every kept label
    stays next to its input. The batch as given when cp_size is 1."""
    if cp_size == 1:
        return batch

    def shard(x):
        if isinstance(x, dict):
            return {k: shard(v) for k, v in x.items()}
        return shard_sequence(x, 1, cp_size, cp_rank)

    return tuple(shard(t) for t in batch)


def unshard_sequence(local_shards: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Rebuild the full sequence from every rank's shard, given in cp-rank order."""
    cp_size = len(local_shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(local_shards):
        if shard.shape[dim] % 2 != 0:
            raise ValueError(f"shard of rank {rank} has odd length {shard.shape[dim]} along dim {dim}")
        first, second = shard.chunk(2, dim=dim)
        head, tail = _chunk_ids(cp_size, rank)
        chunks[head], chunks[tail] = first, second
    return torch.cat(chunks, dim=dim)


def gather_sequence(x: torch.Tensor, dim: int, cp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather every rank's shard over `cp_group` and return the full sequence (no autograd)."""
    shards = [torch.empty_like(x) for _ in range(dist.get_world_size(cp_group))]
    dist.all_gather(shards, x.contiguous(), group=cp_group)
    return unshard_sequence(shards, dim)


# ---------------------------------------------------------------------------------------------------------
# Blockwise attention (fp32, 5-D GQA layout: q [B, Hkv, G, Sq, D], k/v [B, Hkv, 1, Sk, D])
# ---------------------------------------------------------------------------------------------------------


def _block_mask(
    q_ids: torch.Tensor | None, k_ids: torch.Tensor | None, diagonal: bool, shape: tuple[int, int], device
) -> torch.Tensor | None:
    """Visible (query, key) pairs of a block, [B or 1, 1, 1, Sq, Sk] bool, or None when all are visible.

    Diagonal: q and k are the same global chunk, so local index i may see local index j iff j <= i.
    Documents (ids [B, Sq] and [B, Sk]): a query sees keys of its own document only.
    """
    mask = None
    if diagonal:
        mask = torch.ones(shape, dtype=torch.bool, device=device).tril_()
    if q_ids is not None:
        same_doc = (q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)).unsqueeze(1).unsqueeze(1)
        mask = same_doc if mask is None else same_doc & mask
    return mask


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _finite_or_zero(lse: torch.Tensor) -> torch.Tensor:
    # A row with no visible key in a block has lse -inf; subtracting 0 instead keeps its exp() at exactly 0.
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - _finite_or_zero(lse).unsqueeze(-1)), v)
    return out, lse


def _merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running accumulators in place (online softmax).

    Under document masking a row may have no visible key so far (lse -inf) or in this block (block_lse
    -inf); its factor is then exactly 0, and merging an empty block leaves (out, lse) bit-identical.
    """
    new_lse = torch.logaddexp(lse, block_lse)
    ref = _finite_or_zero(new_lse)
    out.mul_(torch.exp(lse - ref).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - ref).unsqueeze(-1))
    lse.copy_(new_lse)


def _block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the FINAL lse and delta = rowsum(dout * out) of the whole attention
    (finite: every token sees at least itself)."""
    p = torch.exp(_scores(q, k, scale, mask) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), dout).sum(dim=2, keepdim=True)
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q).sum(dim=2, keepdim=True) * scale
    return dq, dk, dv


def window_block_state(q_first: int, k_first: int, q_len: int, k_len: int, window: int | None) -> str:
    """Where a (query span, key span) block of global positions stands against causality and a window:
    "empty" (no visible pair), "full" (every pair visible: no mask needed) or "partial"."""
    nearest = q_first - (k_first + k_len - 1)  # the smallest i - j of the block
    farthest = q_first + q_len - 1 - k_first  # the largest
    if farthest < 0 or (window is not None and nearest >= window):
        return "empty"
    if nearest >= 0 and (window is None or farthest < window):
        return "full"
    return "partial"


def window_causal_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Sq, Sk] bool: key position visible to query position (not later, and within the window)."""
    distance = q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)
    visible = distance >= 0
    return visible if window is None else visible & (distance < window)


def fold_sinks_(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Count a sink logit per query head in the softmax denominator of a finished attention, in place.

    out [B, Hkv, G, S, D] and lse [B, Hkv, G, S] (fp32, 5-D GQA layout), sinks [Hkv * G]. Returns the new
    lse, logaddexp(lse, sink): the output shrinks by exp(lse - lse') = sigmoid(lse - sink)."""
    sink = sinks.float().view(1, lse.shape[1], lse.shape[2], 1)
    total = torch.logaddexp(lse, sink)
    out.mul_(torch.exp(lse - total).unsqueeze(-1))
    return total


def sink_grad(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Gradient of the sinks [Hkv * G] given the FINAL lse (sink included) and delta = rowsum(dout * out),
    both [B, Hkv, G, S]: the sink's probability is p_i = exp(sink - lse_i) and its value vector is zero, so
    d sink = sum_i p_i * (0 - delta_i)."""
    sink = sinks.float().view(1, lse.shape[1], lse.shape[2], 1)
    return -(torch.exp(sink - lse) * delta).sum(dim=(0, 3)).flatten().to(sinks.dtype)


def _visible_blocks(cp_size: int, q_rank: int, kv_rank: int) -> list[tuple[int, int, bool]]:
    """(local q chunk, local kv chunk, is_diagonal) for every block that is not fully masked."""
    blocks = []
    for qi, q_chunk in enumerate(_chunk_ids(cp_size, q_rank)):
        for ki, kv_chunk in enumerate(_chunk_ids(cp_size, kv_rank)):
            if q_chunk >= kv_chunk:
                blocks.append((qi, ki, q_chunk == kv_chunk))
    return blocks


# ---------------------------------------------------------------------------------------------------------
# Communication
# ---------------------------------------------------------------------------------------------------------


class _Ring:
    """Point-to-point shifts around the cp group: send to rank+1, receive from rank-1."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def shift(self, t: torch.Tensor, tag: int = 0) -> Callable[[], torch.Tensor]:
        """Start passing `t` on; return a function that waits and yields the tensor from the previous rank.

        `t` must not be modified until the returned function has been called. Shifts in flight at the same time
        take distinct tags: gloo matches a receive by (peer, tag), and a message landing in a receive of another
        size aborts the process from gloo's transport thread.
        """
        if self.size == 1:
            return lambda: t
        received = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + 1) % self.size, tag=tag),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.size, tag=tag),
        ]
        requests = dist.batch_isend_irecv(ops)

        def wait() -> torch.Tensor:
            for request in requests:
                request.wait()
            return received

        return wait


def _all_gather(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[cp, *t.shape] stack of every rank's `t`."""
    size = dist.get_world_size(group)
    if size == 1:
        return t.unsqueeze(0)
    # Gathered as a concatenation along dim 0 (gloo rejects the stacked output form), then viewed as a stack.
    out = t.new_empty((size * t.shape[0], *t.shape[1:]))
    dist.all_gather_single(out, t.contiguous(), group=group)
    return out.view(size, *t.shape)


def _reduce_scatter(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum the [cp, ...] stacks over ranks and return this rank's slice."""
    if t.shape[0] == 1:
        return t[0]
    out = t.new_empty(t.shape[1:])
    dist.reduce_scatter_single(out, t.contiguous().flatten(0, 1), group=group)
    return out


# ---------------------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------------------


def _split_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, B, Hkv, S, D] packed k/v (any dtype) -> fp32 k, v in 5-D layout [B, Hkv, 1, S, D]."""
    kv = kv.float().unsqueeze(3)
    return kv[0], kv[1]


def _chunk(t: torch.Tensor, index: int, chunk_len: int, dim: int = 3) -> torch.Tensor:
    """Local chunk `index` (0 or 1) of a 5-D layout tensor or of its per-row stats (sequence dim 3), or of
    document ids [B, S] (dim 1)."""
    return t.narrow(dim, index * chunk_len, chunk_len)


def _blocks(
    cp_size: int, q_rank: int, kv_rank: int, ids: torch.Tensor | None, chunk_len: int, device,
    window: int | None = None,
) -> list[tuple[int, int, torch.Tensor | None]]:
    """(local q chunk, local kv chunk, mask) of every block with a visible pair: causally masked blocks are
    skipped, and so are blocks wholly outside the window and blocks where no query shares a document with
    any key. ids: [cp, B, S/cp] or None."""
    out = []
    q_chunks, kv_chunks = _chunk_ids(cp_size, q_rank), _chunk_ids(cp_size, kv_rank)
    for qi, ki, diagonal in _visible_blocks(cp_size, q_rank, kv_rank):
        q_first, k_first = q_chunks[qi] * chunk_len, kv_chunks[ki] * chunk_len
        state = window_block_state(q_first, k_first, chunk_len, chunk_len, window)
        if state == "empty":
            continue
        q_ids = _chunk(ids[q_rank], qi, chunk_len, dim=1) if ids is not None else None
        k_ids = _chunk(ids[kv_rank], ki, chunk_len, dim=1) if ids is not None else None
        mask = _block_mask(q_ids, k_ids, diagonal, (chunk_len, chunk_len), device)
        if state == "partial" and not diagonal:  # the diagonal's causal mask is in _block_mask already
            pos = torch.arange(chunk_len, device=device)
            cut = window_causal_mask(q_first + pos, k_first + pos, window)
            mask = cut if mask is None else mask & cut
        elif state == "partial" and window is not None:
            pos = torch.arange(chunk_len, device=device)
            mask = mask & window_causal_mask(pos, pos, window)
        if mask is None or bool(mask.any()):
            out.append((qi, ki, mask))
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup | None,
        rotate_method: RotateMethod,
        document_ids: torch.Tensor | None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ring = _Ring(group)
        # Every rank's document ids (small ints) once, so each block knows both sides' documents.
        ids = _all_gather(document_ids, group) if document_ids is not None else None
        batch, hq, seq, dim = q.shape
        hkv = k.shape[1]
        chunk_len = seq // 2
        scale = dim**-0.5
        q5 = q.float().reshape(batch, hkv, hq // hkv, seq, dim)
        # k and v travel as one packed buffer so each step is a single transfer.
        kv = torch.stack([k, v])

        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)

        def accumulate(kv_rank: int, kv_shard: torch.Tensor) -> None:
            k5, v5 = _split_kv(kv_shard)
            for qi, ki, mask in _blocks(ring.size, ring.rank, kv_rank, ids, chunk_len, q.device, window):
                block_out, block_lse = _block_forward(
                    _chunk(q5, qi, chunk_len), _chunk(k5, ki, chunk_len), _chunk(v5, ki, chunk_len), scale, mask
                )
                _merge_(_chunk(out, qi, chunk_len), _chunk(lse, qi, chunk_len), block_out, block_lse)

        if rotate_method == "allgather":
            kv_saved = _all_gather(kv, group)
            for kv_rank in range(ring.size):
                accumulate(kv_rank, kv_saved[kv_rank])
        else:
            kv_saved = kv
            current = kv
            for step in range(ring.size):
                # Post the next transfer first so it overlaps this step's compute.
                wait = ring.shift(current) if step < ring.size - 1 else None
                accumulate((ring.rank - step) % ring.size, current)
                if wait is not None:
                    current = wait()

        if sinks is not None:  # once, after every key block: the sink is one more logit per row
            lse = fold_sinks_(out, lse, sinks)
        out_q = out.reshape(batch, hq, seq, dim).to(q.dtype)
        ctx.save_for_backward(q, kv_saved, out_q, lse, sinks)
        ctx.group, ctx.rotate_method, ctx.hkv, ctx.ids, ctx.window = group, rotate_method, hkv, ids, window
        return out_q

    @staticmethod
    def backward(ctx, dout: torch.Tensor):  # type: ignore[override]
        q, kv_saved, out, lse, sinks = ctx.saved_tensors
        ring = _Ring(ctx.group)
        batch, hq, seq, dim = q.shape
        hkv = ctx.hkv
        chunk_len = seq // 2
        scale = dim**-0.5
        shape5 = (batch, hkv, hq // hkv, seq, dim)
        q5 = q.float().reshape(shape5)
        do5 = dout.float().reshape(shape5)
        delta = (do5 * out.float().reshape(shape5)).sum(dim=-1)
        dq5 = torch.zeros_like(q5)

        def accumulate(kv_rank: int, kv_shard: torch.Tensor, dkv: torch.Tensor) -> None:
            """Add this rank's contribution to dq and to the visiting shard's packed (dk, dv)."""
            k5, v5 = _split_kv(kv_shard)
            for qi, ki, mask in _blocks(ring.size, ring.rank, kv_rank, ctx.ids, chunk_len, q.device, ctx.window):
                dq, dk, dv = _block_backward(
                    _chunk(q5, qi, chunk_len),
                    _chunk(k5, ki, chunk_len),
                    _chunk(v5, ki, chunk_len),
                    _chunk(do5, qi, chunk_len),
                    _chunk(lse, qi, chunk_len),
                    _chunk(delta, qi, chunk_len),
                    scale,
                    mask,
                )
                _chunk(dq5, qi, chunk_len).add_(dq)
                dkv[0].narrow(-2, ki * chunk_len, chunk_len).add_(dk.squeeze(2))
                dkv[1].narrow(-2, ki * chunk_len, chunk_len).add_(dv.squeeze(2))

        if ctx.rotate_method == "allgather":
            dkv_all = torch.zeros(kv_saved.shape, dtype=torch.float32, device=q.device)
            for kv_rank in range(ring.size):
                accumulate(kv_rank, kv_saved[kv_rank], dkv_all[kv_rank])
            dkv = _reduce_scatter(dkv_all, ctx.group)
        else:
            # The (dk, dv) partial of each shard travels with it; after the last step it is one hop short of
            # its owner, so a final shift delivers every rank its own complete gradient.
            current = kv_saved
            wait_dkv: Callable[[], torch.Tensor] | None = None
            for step in range(ring.size):
                wait_kv = ring.shift(current) if step < ring.size - 1 else None
                if wait_dkv is None:
                    dkv = torch.zeros(kv_saved.shape, dtype=torch.float32, device=q.device)
                else:
                    dkv = wait_dkv()
                accumulate((ring.rank - step) % ring.size, current, dkv)
                wait_dkv = ring.shift(dkv, tag=1)  # in flight with the k/v shift (tag 0), another size in bf16
                if wait_kv is not None:
                    current = wait_kv()
            dkv = wait_dkv()

        dq = dq5.reshape(batch, hq, seq, dim).to(q.dtype)
        # This rank's queries' share of the sink gradient; the parameter's gradient is summed over the cp
        # ranks like every other replicated parameter's.
        dsinks = sink_grad(lse, delta, sinks) if sinks is not None else None
        return dq, dkv[0].to(kv_saved.dtype), dkv[1].to(kv_saved.dtype), None, None, None, None, dsinks


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cp_group: dist.ProcessGroup | None = None,
    rotate_method: RotateMethod = "alltoall",
    document_ids: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of load-balanced local shards q [B, Hq, S/cp, D], k/v [B, Hkv, S/cp, D].

    Returns this rank's shard of the output, equal to full causal SDPA over the unsharded sequence; with
    `document_ids` (this rank's shard [B, S/cp], sharded like q) block-causal within documents; with `window`
    each query sees its last `window` positions only; `sinks` [Hq] adds a logit per head to the denominator.
    """
    if rotate_method not in _ROTATE_METHODS:
        raise ValueError(f"rotate_method must be one of {_ROTATE_METHODS}, got {rotate_method!r}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"expected q [B, Hq, S, D] and k/v [B, Hkv, S, D], got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hkv={k.shape[1]} must divide Hq={q.shape[1]}")
    if q.shape[2] != k.shape[2] or q.shape[2] % 2 != 0:
        raise ValueError(f"local q/k lengths must be equal and even (two chunks), got {q.shape[2]}, {k.shape[2]}")
    return _RingAttention.apply(q, k, v, cp_group, rotate_method, document_ids, window, sinks)


class ContextParallelAttention(nn.Module):
    """Drop-in `inner_attention(q, k, v)` for a model whose sequence is sharded with `shard_sequence`; `window`
    is the attention kind of the kernel it replaces (models/common/attention.py), sinks come with each call."""

    KINDS = frozenset({"window", "sinks"})

    def __init__(
        self, cp_group: dist.ProcessGroup | None = None, rotate_method: RotateMethod = "alltoall",
        window: int | None = None,
    ):
        super().__init__()
        if rotate_method not in _ROTATE_METHODS:
            raise ValueError(f"rotate_method must be one of {_ROTATE_METHODS}, got {rotate_method!r}")
        self.cp_group = cp_group
        self.rotate_method: RotateMethod = rotate_method
        self.window = window

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # The ring passes k and v as one stacked tensor: a narrower v (MLA's value heads) is zero-padded to
        # k's head dim, which adds zero columns to the output, then sliced off.
        v_dim = v.shape[-1]
        if v_dim < k.shape[-1]:
            v = torch.nn.functional.pad(v, (0, k.shape[-1] - v_dim))
        out = ring_attention(q, k, v, self.cp_group, self.rotate_method, document_ids, self.window, sinks)
        return out[..., :v_dim]

    def extra_repr(self) -> str:
        return f"rotate_method={self.rotate_method!r}" + (f", window={self.window}" if self.window else "")
