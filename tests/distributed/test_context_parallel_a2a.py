"""Ulysses and hierarchical context parallel: the attention equals full attention, and bad layouts get one line.

Attention level: every rank builds the same full q/k/v (and document ids) from a seed, the reference is the
model's own kernel (ScaledDotProductAttention) over the whole sequence; the CP kernel runs on the rank's
load-balanced shard and outputs and input gradients are gathered and compared (fp32, atol = rtol = 1e-5).
Head counts cover MHA, GQA whose k/v heads the group divides, and GQA whose k/v heads must be repeated
(1 k/v head over 4 ranks; 2 over 4), with MLA's narrower value heads. Training-level parity (the Trainer, one
process vs. the layouts) lives in test_context_parallel_training.py.
"""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from tests.tolerances import attention_tol
from torchtitan.distributed.context_parallel import gather_sequence, shard_sequence
from torchtitan.distributed.context_parallel_a2a import check_cp_method, group_order
from torchtitan.distributed.parallel_dims import LayoutError

SEQ_DIM = 2


def test_group_order_is_natural_order_when_the_group_is_all_of_cp():
    # cp 4 = one group: shards in rank order hold chunks (0,7) (1,6) (2,5) (3,4); reordered: 0..7.
    chunks = torch.tensor([0, 7, 1, 6, 2, 5, 3, 4])
    assert chunks[group_order(2, 4, "cpu")].tolist() == list(range(8))


def test_group_order_is_the_ring_layout_of_the_groups():
    # cp 4 in 2 groups of 2: group 1 holds ranks 2, 3 = chunks (2,5) (3,4), i.e. super-chunks 1 = (2,3) and
    # 2 = (4,5) of 4 super-chunks: ring rank 1's load-balanced pair over a ring of 2.
    chunks = torch.tensor([2, 5, 3, 4])
    assert chunks[group_order(2, 2, "cpu")].tolist() == [2, 3, 4, 5]


def _compare(rank: int, world_size: int, method: str, a2a_degree: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel_a2a import cp_attention_factory
    from torchtitan.models.common.attention import ScaledDotProductAttention

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    kernel = ScaledDotProductAttention()
    attention = cp_attention_factory(mesh, method, a2a_degree, "alltoall")(kernel)
    batch, hq, seq, dim = 2, 4, 32, 8
    for hkv, v_dim in [(4, dim), (2, dim), (1, dim), (4, 6)]:
        gen = torch.Generator().manual_seed(1234)
        q = torch.randn(batch, hq, seq, dim, generator=gen, requires_grad=True)
        k = torch.randn(batch, hkv, seq, dim, generator=gen, requires_grad=True)
        v = torch.randn(batch, hkv, seq, v_dim, generator=gen, requires_grad=True)
        dout = torch.randn(batch, hq, seq, v_dim, generator=gen)
        # Documents of lengths 5, 11, 16 (row 0) and 20, 12 (row 1): boundaries cross the chunks.
        ids = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16, [0] * 20 + [1] * 12])
        for doc in (None, ids):
            for t in (q, k, v):
                t.grad = None
            ref = kernel(q, k, v) if doc is None else kernel(q, k, v, doc)
            ref.backward(dout)
            local = [shard_sequence(t.detach(), SEQ_DIM, world_size, rank).requires_grad_() for t in (q, k, v)]
            args = local if doc is None else [*local, shard_sequence(doc, 1, world_size, rank)]
            out = attention(*args)
            out.backward(shard_sequence(dout, SEQ_DIM, world_size, rank))
            got = {"out": gather_sequence(out.detach(), SEQ_DIM),
                   **{f"d{n}": gather_sequence(t.grad, SEQ_DIM) for n, t in zip("qkv", local)}}
            want = {"out": ref.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
            for name in got:
                # Measured: uses 0.087 of it (AVX-512), 0.076 (AVX2 caps).
                tol = attention_tol(want[name], seq, dim, gradient=name != "out")
                torch.testing.assert_close(got[name], want[name], **tol,
                                           msg=lambda m: f"hkv={hkv} v_dim={v_dim} docs={doc is not None} {name}: {m}")
    if method == "ulysses":
        # A per-head kernel input (attention sinks) reaches the kernel cut to this rank's head shard.
        seen = {}

        def recorder(q, k, v, sinks):
            seen["sinks"] = sinks
            return q

        wrapped = cp_attention_factory(mesh, method, a2a_degree, "alltoall")(recorder)
        q = torch.zeros(1, hq, seq // world_size, dim)
        wrapped(q, q, q, sinks=torch.arange(hq))
        share = hq // world_size
        assert seen["sinks"].tolist() == list(range(rank * share, (rank + 1) * share))
    dist.barrier()


@pytest.mark.distributed
@pytest.mark.parametrize("method,cp,a2a", [("ulysses", 2, 0), ("ulysses", 4, 0), ("hierarchical", 4, 2)])
def test_a2a_attention_matches_the_kernel_on_the_whole_sequence(method, cp, a2a):
    run_ranks(_compare, cp, method, a2a)


@pytest.mark.parametrize("method,a2a,cp,tp,heads,match", [
    ("ulysses", 2, 4, 1, 8, r"uses all 4 cp ranks as one all-to-all group"),
    ("hierarchical", 1, 4, 1, 8, r"hierarchical context parallel needs .*a2a_degree above 1"),
    ("hierarchical", 0, 4, 1, 8, r"needs .*a2a_degree above 1"),
    ("hierarchical", 3, 6, 1, 12, None),  # fits
    ("hierarchical", 4, 6, 1, 12, r"a2a_degree 4 does not divide context_parallel_degree 6; degrees that fit: \[2, 3\]"),
    ("hierarchical", 4, 4, 1, 8, r"that is --parallelism.context_parallel_method ulysses"),
    ("ulysses", 0, 4, 2, 4, r"splits the 2 attention heads each tensor-parallel rank holds"),
    ("ulysses", 0, 4, 1, 6, r"splits the 6 attention heads .* degrees that fit: \[2\]"),
    ("ring", 2, 4, 1, 8, r"a2a_degree 2 sizes the all-to-all groups"),
    ("ring", 0, 4, 1, 3, None),  # the ring splits no heads
])
def test_bad_layouts_get_one_line(method, a2a, cp, tp, heads, match):
    if match is None:
        check_cp_method(method, a2a, cp, tp, heads)
        return
    with pytest.raises(LayoutError, match=match) as err:
        check_cp_method(method, a2a, cp, tp, heads)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv,code,start", [
    (["--parallelism.context_parallel_method", "hierarchical", "--parallelism.context_parallel_a2a_degree", "1"],
     1, "error: hierarchical context parallel needs --parallelism.context_parallel_a2a_degree above 1"),
    (["--parallelism.context_parallel_method", "hierarchical", "--parallelism.context_parallel_a2a_degree", "3"],
     1, "error: --parallelism.context_parallel_a2a_degree 3 does not divide context_parallel_degree 4"),
    (["--parallelism.context_parallel_method", "ulysses", "--parallelism.tensor_parallel_degree", "2",
      "--parallelism.context_parallel_degree", "2"],
     None, None),  # 4 heads / tp 2 = 2 heads per rank: a group of 2 splits them
    (["--parallelism.context_parallel_method", "ulysses", "--parallelism.context_parallel_degree", "8",
      "--parallelism.data_parallel_shard_degree", "1"], 1, "error: ulysses context parallel splits the 4 attention heads"),
    (["--parallelism.context_parallel_method", "allgather"], 2, "error: --parallelism.context_parallel_method"),
])
def test_preflight_refuses_bad_cp_methods_in_one_line(argv, code, start, capsys):
    from torchtitan import preflight

    world = "8" if "8" in argv else "4"
    base = ["--world-size", world, "--model.flavor", "debugmodel_tiny", "--parallelism.context_parallel_degree", "4"]
    assert preflight.main(base + argv) == (code or 0)
    err = capsys.readouterr().err.strip()
    if code is None:
        assert err == ""
        return
    assert err.count("\n") == 0 and err.startswith(start), err


def _saved_activation_bytes(rank: int, world_size: int, seq: int, method: str) -> int:
    """Bytes autograd keeps over one forward of debugmodel_tiny (parameters excluded), this rank's slice."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import shard_batch
    from torchtitan.distributed.parallelize import apply_cp
    from torchtitan.models.llama3.flavors import llama3_flavors
    from torchtitan.models.llama3.model import Transformer

    torch.manual_seed(0)
    model = Transformer(llama3_flavors["debugmodel_tiny"])
    model.init_weights()
    if world_size > 1:
        apply_cp(model, init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",)), seq_len=seq,
                 rotate_method="alltoall", method=method)
    else:  # RoPE rows gathered by position as under CP (not a view of the whole table), so bytes halve exactly
        model.fixed_positions = torch.arange(seq)
    tokens = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(1))
    (local,) = shard_batch((tokens,), rank, world_size)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(local)
    return sum(storages.values())


@pytest.mark.distributed
def test_memory_estimator_counts_the_extra_attention_output_of_ulysses():
    """Ulysses keeps, beyond 1/cp of the one-process activations, the head-sharded attention output: the
    estimator's extra D per token per block (planning/memory.py), plus two small index vectors per block."""
    from torchtitan.models.llama3.flavors import llama3_flavors
    from torchtitan.planning.memory import ModelShape, RankWork, StateBytes, estimate_memory

    seq, cp = 512, 2
    whole = run_ranks(_saved_activation_bytes, 1, seq, "ring")[0]
    ulysses = max(run_ranks(_saved_activation_bytes, cp, seq, "ulysses"))
    shape = ModelShape.from_args(llama3_flavors["debugmodel_tiny"])
    work = dict(tokens_per_microbatch=seq, blocks=2, cp=cp, ac="none", act_bytes=4)
    state = StateBytes(0, 0, 0, 0)
    extra = (estimate_memory(shape, state, RankWork(**work, cp_all_to_all=True)).components["activations"]
             - estimate_memory(shape, state, RankWork(**work)).components["activations"])
    assert extra == seq // cp * 64 * 2 * 4
    index_vectors = 2 * seq * 8 * 2  # group order and its inverse, int64, per block
    assert extra <= ulysses - whole / cp <= 1.1 * (extra + index_vectors), (ulysses - whole / cp, extra)
