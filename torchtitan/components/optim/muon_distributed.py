"""Newton-Schulz once per group of ranks that share a matrix: each matrix is orthogonalised by one rank of
the mesh it is sharded over, and the result goes back to the others as their shards.

For the Muon matrices sharded over one device mesh (FSDP's dp_shard, TP's tp, both, HSDP's replicate x
shard), per step:
1. each update is redistributed to the mesh's canonical row blocks, (Shard(0),) on every mesh dimension
   (nothing moves under FSDP alone; a TP column shard goes through an all-to-all);
2. every matrix has an owner, chosen by `assign_owners` so that the ranks' Newton-Schulz FLOPs balance;
   each rank's row block of every matrix is gathered to its owner (all gathers issued at once, async);
3. each owner orthogonalises its matrices as their gathers land, and scatters each result's row blocks back
   (async, so its next matrix's work overlaps the scatter in flight);
4. each rank rebuilds its shard of the result in the update's own placements.

Exact: the owner orthogonalises the same full matrix, bit for bit, that one process would (the gathers only
move data), so the update equals the single-process one. Cost per rank: the Newton-Schulz FLOPs of its own
matrices, at most total/N + the largest matrix's (`assign_owners`), instead of the total; traffic: each row
block goes to its owner and back, about the all-gather it replaces (a gather and a scatter move (N-1)/N of a
matrix each, through the owner).

Plain tensors (one process; DDP's replicated parameters) are orthogonalised where they are, as before.
"""

import dataclasses
import heapq

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard


def ns_flops(shape: tuple[int, ...], steps: int) -> int:
    """FLOPs of `steps` quintic Newton-Schulz iterations on an m x n matrix, in its wide orientation (r =
    min(m, n) rows, c = max(m, n) columns): per step the Gram matrix X X^T (2 r^2 c), its square (2 r^3)
    and the product with X (2 r^2 c)."""
    r, c = sorted(shape)
    return steps * (4 * r * r * c + 2 * r**3)


def assign_owners(costs: list[int], n_ranks: int) -> list[int]:
    """Owner rank of each job: greedy longest-processing-time first (jobs by falling cost, each to the rank
    with the least load so far, ties to the lower rank). Deterministic, so every rank computes the same
    assignment. Bound (Graham): the most loaded rank's load <= sum(costs) / n_ranks + max(costs), since the
    last job it took went to the least loaded rank, which then held at most the average."""
    if n_ranks < 1:
        raise ValueError(f"Muon's Newton-Schulz work needs at least one rank to run on, got {n_ranks}")
    owners = [0] * len(costs)
    loads = [(0, r) for r in range(n_ranks)]
    for job in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        load, rank = heapq.heappop(loads)
        owners[job] = rank
        heapq.heappush(loads, (load + costs[job], rank))
    return owners


def ns_workspace_bytes(shape: tuple[int, int], elem_bytes: int, ns_bytes: int) -> int:
    """Bytes the rank orthogonalising one m x n matrix holds for it at once, beyond its shard: the matrix
    joined from the gathered blocks and the result's padded blocks scattered back (`elem_bytes`, the
    update's dtype), the Newton-Schulz iterate, its next value and the product (m x n each) and three r x r
    Gram-sized temporaries (`ns_bytes`)."""
    m, n = shape
    r = min(m, n)
    return 2 * m * n * elem_bytes + (3 * m * n + 3 * r * r) * ns_bytes


def owner_bytes(shapes: list[tuple[int, int]], n_ranks: int, position: int, steps: int, elem_bytes: int,
                ns_bytes: int) -> tuple[int, int | None]:
    """(bytes, index of the largest matrix it owns or None) that the rank at `position` of a mesh of
    `n_ranks` needs at the optimizer step for these Muon matrices (in the optimizer's order, which fixes
    `assign_owners`): every owned matrix's gathered blocks at once (the gathers are all issued before the
    first Newton-Schulz), plus the workspace of the largest owned one. One rank (n_ranks 1) owns all."""
    owners = assign_owners([ns_flops(s, steps) for s in shapes], n_ranks)
    mine = [i for i, o in enumerate(owners) if o == position]
    if not mine:
        return 0, None
    gathered = sum(shapes[i][0] * shapes[i][1] for i in mine) * elem_bytes if n_ranks > 1 else 0
    largest = max(mine, key=lambda i: shapes[i][0] * shapes[i][1])
    return gathered + ns_workspace_bytes(shapes[largest], elem_bytes, ns_bytes), largest


def row_blocks(rows: int, mesh_shape: tuple[int, ...]) -> list[int]:
    """Rows of each rank's block (ranks in row-major mesh order) under (Shard(0),) on every mesh dimension:
    DTensor's torch.chunk split, nested one mesh dimension after another (trailing blocks may be empty)."""
    blocks = [rows]
    for size in mesh_shape:
        nested = []
        for n in blocks:
            chunks = [len(c) for c in torch.empty(n, 0).chunk(size)] if n else []
            nested += chunks + [0] * (size - len(chunks))
        blocks = nested
    return blocks


@dataclasses.dataclass
class _Matrix:
    update: DTensor
    local: torch.Tensor  # this rank's canonical row block
    blocks: list[int]
    owner: int


class DistributedOrthogonaliser:
    """Orthogonalises a step's Muon updates with each matrix's Newton-Schulz on one rank of its mesh.
    `flops_done` counts this rank's Newton-Schulz FLOPs over its life (the balance test reads it)."""

    def __init__(self) -> None:
        self.flops_done = 0
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def _group(self, mesh: DeviceMesh) -> tuple[dist.ProcessGroup, list[int]]:
        """A group of every rank of the mesh, and the group rank of each row-major mesh position (the order
        of row_blocks). Not mesh._flatten(): once a mesh has a flattened twin, torch 2.13's DTensor merges
        its all-gathers over it and gets uneven (Shard(0), Shard(0)) blocks wrong (rows of other ranks)."""
        order = mesh.mesh.flatten().tolist()
        key = tuple(order)
        if key not in self._groups:
            self._groups[key] = dist.new_group(sorted(order), use_local_synchronization=True)
        group = self._groups[key]
        return group, [dist.get_group_rank(group, r) for r in order]

    def __call__(self, updates: list[torch.Tensor], steps: int, ns) -> list[torch.Tensor]:
        """`ns(matrix)` orthogonalises one whole matrix; returns the results in the updates' layouts."""
        results: list[torch.Tensor | None] = [None] * len(updates)
        by_mesh: dict[int, list[int]] = {}
        for i, u in enumerate(updates):
            if isinstance(u, DTensor) and u.device_mesh.size() > 1:
                by_mesh.setdefault(id(u.device_mesh), []).append(i)
            else:
                self.flops_done += ns_flops(tuple(u.shape), steps)
                results[i] = ns(u.to_local() if isinstance(u, DTensor) else u)
                if isinstance(u, DTensor):
                    results[i] = DTensor.from_local(results[i], u.device_mesh, u.placements, run_check=False)
        for indices in by_mesh.values():
            for i, out in zip(indices, self._on_mesh([updates[i] for i in indices], steps, ns)):
                results[i] = out
        return results

    def _on_mesh(self, updates: list[DTensor], steps: int, ns) -> list[DTensor]:
        mesh = updates[0].device_mesh
        group, group_rank = self._group(mesh)
        n = len(group_rank)
        me = group_rank.index(dist.get_rank(group))  # this rank's row-major position in the mesh
        canonical = [Shard(0)] * mesh.ndim
        owners = assign_owners([ns_flops(tuple(u.shape), steps) for u in updates], n)
        mats = [
            _Matrix(u, u.redistribute(mesh, canonical).to_local(), row_blocks(u.shape[0], tuple(mesh.shape)), o)
            for u, o in zip(updates, owners)
        ]
        # 2. every row block to its owner; gathers need equal sizes, so blocks are padded to the largest.
        gathers = []
        for m in mats:
            pad = _padded(m.local, m.blocks[0])
            into = [torch.empty_like(pad) for _ in range(n)] if me == m.owner else None
            dst = dist.get_global_rank(group, group_rank[m.owner])
            gathers.append((into, dist.gather(pad, into, dst=dst, group=group, async_op=True)))
        # 3. the owner's Newton-Schulz as its gathers land; the results' blocks scattered back.
        scatters = []
        for m, (into, gather) in zip(mats, gathers):
            out = torch.empty((m.blocks[0], *m.local.shape[1:]), dtype=m.local.dtype, device=m.local.device)
            pieces = None
            if me == m.owner:
                gather.wait()
                full = torch.cat([into[group_rank[p]][:rows] for p, rows in enumerate(m.blocks)])
                ortho = ns(full)
                self.flops_done += ns_flops(tuple(full.shape), steps)
                by_position = [_padded(piece, m.blocks[0]) for piece in ortho.split(m.blocks)]
                pieces = [by_position[group_rank.index(g)] for g in range(n)]
            src = dist.get_global_rank(group, group_rank[m.owner])
            scatters.append((out, dist.scatter(out, pieces, src=src, group=group, async_op=True)))
        for _, gather in gathers:
            gather.wait()
        # 4. each rank's block of each result, back in the update's placements.
        results = []
        for m, (out, scatter) in zip(mats, scatters):
            scatter.wait()
            block = out[: m.blocks[me]]
            full_shape = tuple(m.update.shape)
            ortho = DTensor.from_local(block, mesh, canonical, run_check=False, shape=full_shape,
                                       stride=torch.empty(full_shape, device="meta").stride())
            results.append(ortho.redistribute(mesh, m.update.placements))
        return results


def _padded(block: torch.Tensor, rows: int) -> torch.Tensor:
    """`block` with zero rows appended up to `rows` (contiguous, as collectives need)."""
    if block.shape[0] == rows:
        return block.contiguous()
    out = block.new_zeros((rows, *block.shape[1:]))
    out[: block.shape[0]] = block
    return out
