"""Context parallel by all-to-all (Ulysses) and hierarchical CP (all-to-all inside groups, ring across them).

The sequence layout is the one ring attention uses (context_parallel.py): 2*cp chunks, cp rank r holding
chunks r and 2*cp-1-r. Only the attention kernel changes.

Ulysses. An all-to-all over a group of A cp ranks turns q/k/v from sequence shards with every head
[B, H, S/cp, D] into head shards over the group's whole sequence [B, H/A, A*S/cp, D]; the model's own
attention kernel (document masking and whatever else it does) runs on them; a second all-to-all turns the
output back into sequence shards. Each all-to-all moves (A-1)/A of the tensor it carries, so a layer moves
about (A-1)/A x (q + k + v + out) per rank: 4/cp of the activations for large cp, against ring attention's
(cp-1)/cp of the whole sequence's k/v.

Order. After the all-to-all the group's positions arrive in group-rank order: rank i's two chunks, then rank
i+1's. Taking the first chunk of every rank in order, then the second chunks in reverse, gives chunks
gA..gA+A-1 followed by chunks 2cp-A(g+1)..2cp-1-gA (g = the group's index): with A = cp that is the natural
order 0..2cp-1, which the ordinary kernel needs; otherwise it is super-chunks g and 2R-1-g of a sequence cut
into 2R super-chunks (R = cp/A groups), which is exactly ring attention's load-balanced layout over R ranks.
Hierarchical CP therefore runs the unchanged ring attention across the groups (ranks with the same index in
each group) on the head shards, and Ulysses is its special case R = 1 with the model's own kernel.

Grouped-query attention. The group must divide the query heads the rank holds (after tensor parallel). k/v
heads are split as they are when A divides them; otherwise each is repeated just enough times
(A / gcd(A, Hkv)) that A divides their count, keeping query head h's key head the same. Group
rank j attends with the query heads [j*H/A, (j+1)*H/A) of the rank's heads; per-head kernel inputs
(PER_HEAD_KWARGS, e.g. sinks) are cut to them.
"""

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.distributed.context_parallel import ContextParallelAttention, RotateMethod
from torchtitan.distributed.parallel_dims import LayoutError

CPMethod = Literal["ring", "ulysses", "hierarchical"]
CP_METHODS = ("ring", "ulysses", "hierarchical")
PER_HEAD_KWARGS = ("sinks",)
"""Keyword inputs of an attention kernel that hold one entry per query head (e.g. attention sinks)."""


# ---------------------------------------------------------------------------------------------------------
# Pre-flight
# ---------------------------------------------------------------------------------------------------------


def a2a_group_size(method: CPMethod, a2a_degree: int, cp: int) -> int:
    """Ranks of one all-to-all group: 1 for ring, cp for ulysses, a2a_degree for hierarchical."""
    return {"ring": 1, "ulysses": cp, "hierarchical": a2a_degree}[method]


def check_cp_method(method: str, a2a_degree: int, cp: int, tp: int, n_heads: int | None) -> None:
    """Raises LayoutError with one line when the CP method cannot run this layout (called by plan_job).
    n_heads: the model's query heads (None when the model does not declare them)."""
    flag = "--parallelism.context_parallel_a2a_degree"
    if method not in CP_METHODS:
        raise LayoutError(f"--parallelism.context_parallel_method {method!r} is not one of {CP_METHODS}")
    if a2a_degree < 0:
        raise LayoutError(f"{flag} must be 0 (all cp ranks, for ulysses) or a divisor of context_parallel_degree, "
                          f"got {a2a_degree}")
    if cp <= 1:
        return
    fits = [d for d in range(2, cp) if cp % d == 0]
    if method == "ring":
        if a2a_degree:
            raise LayoutError(f"{flag} {a2a_degree} sizes the all-to-all groups of methods ulysses and hierarchical; "
                              f"context_parallel_method ring has none: drop it, or pick one of those methods")
        return
    if method == "ulysses":
        if a2a_degree not in (0, cp):
            raise LayoutError(f"ulysses context parallel uses all {cp} cp ranks as one all-to-all group, got {flag} "
                              f"{a2a_degree}: leave it 0, or use --parallelism.context_parallel_method hierarchical")
    else:
        if a2a_degree <= 1:
            raise LayoutError(f"hierarchical context parallel needs {flag} above 1 (all-to-all inside groups of that "
                              f"many ranks, ring across them), got {a2a_degree}; degrees that fit cp {cp}: {fits} "
                              f"(or use context_parallel_method ring)")
        if cp % a2a_degree:
            raise LayoutError(f"{flag} {a2a_degree} does not divide context_parallel_degree {cp}; degrees that "
                              f"fit: {fits}")
        if a2a_degree == cp:
            raise LayoutError(f"{flag} {cp} = context_parallel_degree leaves a ring of one group: that is "
                              f"--parallelism.context_parallel_method ulysses")
    group = a2a_group_size(method, a2a_degree, cp)  # type: ignore[arg-type]
    if n_heads is not None and (n_heads % tp or (n_heads // tp) % group):
        local = n_heads // tp
        ok = [d for d in range(2, cp + 1) if cp % d == 0 and local % d == 0]
        raise LayoutError(
            f"{method} context parallel splits the {local} attention heads each tensor-parallel rank holds "
            f"(n_heads {n_heads} / tensor_parallel_degree {tp}) over all-to-all groups of {group} ranks, which "
            f"do not divide them; all-to-all degrees that fit: {ok or 'none'} (or use context_parallel_method ring)"
        )


# ---------------------------------------------------------------------------------------------------------
# The all-to-alls
# ---------------------------------------------------------------------------------------------------------


def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Block i of x (split on dim 0) goes to group rank i; block i of the result came from group rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # after contiguous(): empty_like keeps a transposed input's strides
    dist.all_to_all_single(out, x, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The exchange is a permutation of blocks whose adjoint is the same exchange on the gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _all_to_all(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, H, L, D] (this rank's sequence shard, every head) -> [B, H/A, A*L, D] (head shard j of the
    group's sequence, shards in group-rank order). Head shard j = heads [j*H/A, (j+1)*H/A)."""
    a = dist.get_world_size(group)
    b, h, length, d = x.shape
    blocks = x.reshape(b, a, h // a, length, d).transpose(0, 1)
    received = _AllToAll.apply(blocks, group)  # [A (source rank), B, H/A, L, D]
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // a, a * length, d)


def heads_to_sequence(y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: [B, H/A, A*L, D] -> [B, H, L, D]."""
    a = dist.get_world_size(group)
    b, hs, total, d = y.shape
    blocks = y.reshape(b, hs, a, total // a, d).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(blocks, group)  # [A (source = head shard), B, H/A, L, D]
    return received.transpose(0, 1).reshape(b, a * hs, total // a, d)


def group_order(local_len: int, a: int, device) -> torch.Tensor:
    """Indices that reorder a group-rank-ordered sequence (A shards of two chunks each) into super-chunks g
    and 2R-1-g, each in natural order (the whole sequence in natural order when the group is all of cp)."""
    idx = torch.arange(a * local_len, device=device).view(a, 2, local_len // 2)
    return torch.cat([idx[:, 0].flatten(), idx.flip(0)[:, 1].flatten()])


def _gather_ids(ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every group rank's document ids [B, L], concatenated along the sequence in group-rank order."""
    a = dist.get_world_size(group)
    out = ids.new_empty((a * ids.shape[0], ids.shape[1]))
    dist.all_gather_single(out, ids.contiguous(), group=group)
    return out.view(a, *ids.shape).transpose(0, 1).reshape(ids.shape[0], -1)


def _repeat_kv_for_group(k: torch.Tensor, a: int) -> torch.Tensor:
    """Repeat each k/v head the fewest times that makes their count divisible by the group size."""
    times = a // math.gcd(a, k.shape[1])
    return k.repeat_interleave(times, dim=1) if times > 1 else k


class AllToAllAttention(nn.Module):
    """Drop-in `inner_attention(q, k, v[, document_ids])` for load-balanced sequence shards: all-to-all to
    head shards over `a2a_group`, then `kernel` (Ulysses: the model's own) or ring attention over
    `ring_group` (hierarchical), then all-to-all back."""

    def __init__(self, kernel: nn.Module, a2a_group: dist.ProcessGroup, ring_group: dist.ProcessGroup | None = None,
                 rotate_method: RotateMethod = "alltoall"):
        super().__init__()
        self.a2a_group = a2a_group
        self.ring_group = ring_group
        # Ulysses keeps the model's kernel (a child, so its parameters stay where they were); hierarchical CP
        # attends across the groups with the ring.
        # The kernel's sliding window (an attention kind, models/common/attention.py) carries over to the ring.
        self.kernel = kernel if ring_group is None else ContextParallelAttention(
            ring_group, rotate_method, getattr(kernel, "window", None))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor | None = None,
        **kernel_kwargs,
    ) -> torch.Tensor:
        """kernel_kwargs go to the kernel; those named in PER_HEAD_KWARGS ([Hq, ...] tensors, one entry per
        query head of the rank) are cut to this group rank's head shard first."""
        a = dist.get_world_size(self.a2a_group)
        if q.shape[1] % a:
            raise ValueError(f"an all-to-all group of {a} ranks cannot split {q.shape[1]} query heads")
        shard = q.shape[1] // a
        first = dist.get_rank(self.a2a_group) * shard
        kernel_kwargs = {name: value.narrow(0, first, shard) if name in PER_HEAD_KWARGS else value
                         for name, value in kernel_kwargs.items()}
        k, v = _repeat_kv_for_group(k, a), _repeat_kv_for_group(v, a)
        order = group_order(q.shape[2], a, q.device)
        q, k, v = (sequence_to_heads(t, self.a2a_group).index_select(2, order) for t in (q, k, v))
        if document_ids is None:
            out = self.kernel(q, k, v, **kernel_kwargs)
        else:
            ids = _gather_ids(document_ids, self.a2a_group).index_select(1, order)
            out = self.kernel(q, k, v, ids, **kernel_kwargs)
        return heads_to_sequence(out.index_select(2, torch.argsort(order)), self.a2a_group)

    def extra_repr(self) -> str:
        return f"a2a={dist.get_world_size(self.a2a_group)}, ring={self.ring_group is not None}"


def cp_attention_factory(
    cp_mesh: DeviceMesh, method: CPMethod, a2a_degree: int, rotate_method: RotateMethod
) -> Callable[[nn.Module], nn.Module]:
    """A function from a block's attention kernel to its context-parallel replacement for `method`."""
    if method == "ring":
        # The kernel's sliding window (an attention kind) carries over to ring attention.
        return lambda kernel: ContextParallelAttention(cp_mesh.get_group(), rotate_method, getattr(kernel, "window", None))
    if method == "ulysses":
        return lambda kernel: AllToAllAttention(kernel, cp_mesh.get_group())
    cp = cp_mesh.size()
    # cp rank r = g * a2a_degree + i: the all-to-all group holds consecutive cp ranks (a node's fast links),
    # the ring the ranks with the same i. Every rank builds the same sub-meshes (a collective call).
    sub = cp_mesh._unflatten(0, (cp // a2a_degree, a2a_degree), ("cp_ring", "cp_a2a"))
    a2a_group, ring_group = sub["cp_a2a"].get_group(), sub["cp_ring"].get_group()
    return lambda kernel: AllToAllAttention(kernel, a2a_group, ring_group, rotate_method)
