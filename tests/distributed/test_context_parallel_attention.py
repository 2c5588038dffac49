"""Context-parallel ring attention must equal full causal attention, forward and backward.

Every rank builds the same full q/k/v from a fixed seed, computes the reference with
F.scaled_dot_product_attention(is_causal=True) on the whole sequence, then runs ContextParallelAttention on its
load-balanced shard and gathers outputs and input gradients. Tolerance: tests/tolerances.attention_tol (fp32).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.multiprocess import run_ranks
from tests.tolerances import attention_tol
from torchtitan.distributed.context_parallel import (
    ContextParallelAttention,
    _visible_blocks,
    gather_sequence,
    load_balanced_indices,
    shard_sequence,
    unshard_sequence,
)

SEQ_DIM = 2


# ---------------------------------------------------------------------------------------------------------
# Index math (single process)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_indices_cover_every_position_once(cp_size):
    seq_len = 8 * cp_size
    held = torch.cat([load_balanced_indices(seq_len, cp_size, r) for r in range(cp_size)])
    assert torch.equal(held.sort().values, torch.arange(seq_len))


def test_indices_layout_cp2():
    # 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 holds chunks 1 and 2.
    assert load_balanced_indices(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_indices(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_causal_work_is_balanced(cp_size):
    # Under a causal mask, the query at position p attends to p + 1 keys.
    seq_len = 4 * cp_size
    work = [int((load_balanced_indices(seq_len, cp_size, r) + 1).sum()) for r in range(cp_size)]
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp_size", [2, 4])
def test_every_ring_step_costs_the_same(cp_size):
    # A visiting shard from another rank is worth exactly two full blocks; the own shard two diagonal
    # blocks plus one full block. Equal cost per step means no rank waits on another in the ring.
    for q_rank in range(cp_size):
        for kv_rank in range(cp_size):
            kinds = sorted(diagonal for _, _, diagonal in _visible_blocks(cp_size, q_rank, kv_rank))
            assert kinds == ([False, True, True] if q_rank == kv_rank else [False, False])


def test_shard_unshard_roundtrip():
    x = torch.randn(2, 3, 24, 5)
    shards = [shard_sequence(x, SEQ_DIM, 3, r) for r in range(3)]
    assert shards[1].shape == (2, 3, 8, 5)
    assert torch.equal(shards[2], x[:, :, load_balanced_indices(24, 3, 2)])
    assert torch.equal(unshard_sequence(shards, SEQ_DIM), x)


def test_bad_seq_len_names_the_numbers():
    with pytest.raises(ValueError, match=r"seq_len=30.*multiple of 8.*nearest valid seq_len is 32"):
        load_balanced_indices(30, 4, 0)
    with pytest.raises(ValueError, match=r"nearest valid seq_len is 24"):
        shard_sequence(torch.zeros(1, 1, 25, 1), SEQ_DIM, 4, 0)


# ---------------------------------------------------------------------------------------------------------
# Ring attention against the reference (multi-process)
# ---------------------------------------------------------------------------------------------------------


def _compare_with_reference(rank: int, world_size: int, rotate_method: str) -> dict[str, float]:
    """Run MHA and GQA through the ring; return max abs errors (asserting is done here too, per rank)."""
    errors = {}
    attention = ContextParallelAttention(dist.group.WORLD, rotate_method)
    for heads, hkv in [("mha", 4), ("gqa", 2)]:
        gen = torch.Generator().manual_seed(1234)
        batch, hq, seq, dim = 2, 4, 32, 8
        q = torch.randn(batch, hq, seq, dim, generator=gen, requires_grad=True)
        k = torch.randn(batch, hkv, seq, dim, generator=gen, requires_grad=True)
        v = torch.randn(batch, hkv, seq, dim, generator=gen, requires_grad=True)
        dout = torch.randn(batch, hq, seq, dim, generator=gen)

        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != hq)
        ref.backward(dout)

        local = [shard_sequence(t.detach(), SEQ_DIM, world_size, rank).requires_grad_() for t in (q, k, v)]
        out = attention(*local)
        out.backward(shard_sequence(dout, SEQ_DIM, world_size, rank))

        results = {
            "out": (gather_sequence(out.detach(), SEQ_DIM), ref.detach()),
            **{
                f"d{name}": (gather_sequence(t.grad, SEQ_DIM), full.grad)
                for name, t, full in zip("qkv", local, (q, k, v))
            },
        }
        for name, (got, want) in results.items():
            errors[f"{heads}/{name}"] = float((got - want).abs().max())
            # the ring's per-block partial softmaxes merged by log-sum-exp: the same sums, another order. Measured: uses
            # 0.089 of it (AVX-512), 0.075 (AVX2 caps).
            tol = attention_tol(want, seq, dim, gradient=name != "out")
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{heads} {name}: {m}")
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("rotate_method", ["allgather", "alltoall"])
@pytest.mark.parametrize("cp_size", [2, 4])
def test_ring_attention_matches_full_causal_attention(cp_size, rotate_method):
    per_rank = run_ranks(_compare_with_reference, cp_size, rotate_method)
    assert len(per_rank) == cp_size


@pytest.mark.distributed
def test_cp1_is_plain_causal_attention():
    run_ranks(_compare_with_reference, 1, "alltoall")


def _saved_bytes(rank: int, world_size: int) -> dict[str, int]:
    """Bytes the ring attention stores for backward on this rank, per rotate method."""
    batch, hq, hkv, seq, dim = 1, 4, 2, 64, 8
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, hq, seq // world_size, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, hkv, seq // world_size, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, hkv, seq // world_size, dim, generator=gen, requires_grad=True)
    result = {}
    for rotate_method in ("alltoall", "allgather"):
        saved = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            ContextParallelAttention(dist.group.WORLD, rotate_method)(q, k, v)
        result[rotate_method] = sum(saved)
    return result


@pytest.mark.distributed
def test_alltoall_saves_only_the_local_shard():
    world_size, batch, hq, hkv, seq, dim = 2, 1, 4, 2, 64, 8
    local = seq // world_size
    # q, out and the packed local k/v in fp32, plus one fp32 lse per query row.
    expected = 4 * (2 * batch * hq * local * dim + 2 * batch * hkv * local * dim + batch * hq * local)
    for saved in run_ranks(_saved_bytes, world_size):
        assert saved["alltoall"] == expected
        # allgather keeps every rank's k/v instead of only the local shard.
        assert saved["allgather"] == expected + (world_size - 1) * 4 * 2 * batch * hkv * local * dim
