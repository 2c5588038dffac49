"""Memory budget planner: per transformer block keep, op (selective recompute), full (recompute), offload or
full_offload (recompute from an input that was offloaded), the mix with the least predicted step time whose
per-rank peak stays within `--memory.budget_gib`.

SwapAdvisor's question asked of whole blocks. Inputs, per block of the busiest rank (the first pipeline rank,
which keeps the most microbatches in flight; every stage then uses the plan of its position):
  bytes    what the block keeps for backward under each choice (the estimator's per-block formulas,
           planning/memory.py, x tokens x microbatches in flight), and what it holds for a while on top
           (transient): recomputation rebuilds what it did not keep during the block's backward; offload keeps
           nothing, but while the groups move RESIDENT_GROUPS groups (one microbatch's saved tensors of one
           block each) are in RAM with prefetch (the one being written while the next block runs forward; the
           one in use and the one prefetched in backward), one without (distributed/activation_offload.py).
           Transients of different blocks come at different times: a plan counts the largest
  seconds  what the choice adds to a step: full = the block's forward over the step's microbatches (FLOPs at
           `mfu` of the device's peak); op = OP_RECOMPUTE_FRACTION of it; offload with prefetch = per
           microbatch, the write (group bytes / tier bandwidth) minus the next block's forward it overlaps, plus
           the read minus the next block's backward (2 forwards) it overlaps (the last block overlaps the
           output projection's forward instead); without prefetch, the write and the read in full. The planner
           tries offload with and without prefetch (--memory.offload_prefetch) and keeps the better plan.
           full_offload = full's forward plus its input written and read back in full (never prefetched: it
           keeps nothing, and holds one block's recomputation, input included, in its backward)
The peak is the estimator's (planning/memory.py, `RankWork.block_activation_bytes` and
`block_transient_bytes`): the larger of the start of backward (kept bytes + the loss's temporaries) and a
block's backward (kept bytes + the largest transient + the gradients), monotone in both, so for each largest
transient T the budget becomes a cap on the kept bytes (`activation_room(...)(T)`, by bisection).

Search (`solve`): exact. For each candidate largest transient T (0, or any block's transient under any
allowed choice), a dynamic programme over the blocks, with memory in units of the gcd of the blocks' kept
bytes (so the discretisation is exact; above MAX_UNITS units bytes are rounded up, which keeps the plan within
the budget but may miss a plan at its very edge, and the plan says so), minimises the added seconds subject
to kept bytes <= the cap for T, each block limited to the choices whose transient is <= T. The best over all T
is optimal: the optimal plan's largest transient is one of the candidates. `brute_force` checks it
(tests/unit/test_memory_budget.py), and the same check catches a greedy rule.
"""

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Callable

import numpy as np
import torch

from torchtitan.planning.memory import (
    MemoryEstimate,
    ModelShape,
    RankWork,
    StateBytes,
    block_elems_per_token,
    estimate_memory,
    rank_work,
)
from torchtitan.planning.step_time import DEFAULT_MFU

CHOICES = ("keep", "op", "full", "offload", "full_offload")
RESIDENT_GROUPS = 2
"""Offloaded groups resident at once (see the module docstring)."""
OFFLOAD_BANDWIDTH_CPU = 1.0
"""GB/s each way of the CPU file tier when not given (--memory.offload_bandwidth_gbps): a conservative local
SSD figure; scripts/benchmarks/bench_memory_budget.py measures the machine's and passes it."""
OFFLOAD_BANDWIDTH_CUDA = 20.0
"""GB/s each way of pinned host memory over PCIe 4/5 x16 (stated, not measured here)."""
OP_RECOMPUTE_FRACTION = 0.1
"""Share of a block's forward time that selective "op" recompute adds (it redoes norms, RoPE, SiLU and
products, no matmul): stated; these ops are memory-bound and a few % to ~15% of a block's forward."""
MAX_UNITS = 1_000_000
"""Largest memory axis of the dynamic programme."""


@dataclasses.dataclass(frozen=True)
class BlockCost:
    bytes: tuple[int, ...]
    """Bytes the block keeps for backward until its backward, per choice of CHOICES (offload, full_offload:
    0)."""
    seconds: tuple[float, ...]
    """Seconds the choice adds to a step, per choice of CHOICES (keep: 0)."""
    transient: tuple[int, ...]
    """Bytes the choice holds for a while on top (per choice): what recomputation rebuilds during the block's
    backward, or the offloaded groups in RAM while they move. Transients of different blocks happen at
    different times, so a plan counts only the largest."""


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    choices: tuple[str, ...]
    activation_bytes: int
    """Kept bytes of every block + the largest transient."""
    seconds: float
    """Seconds the plan adds to a step."""
    exact: bool = True
    """False when the memory axis was coarsened (bytes rounded up; see the module docstring)."""
    transient_bytes: int = 0
    """The largest transient (part of activation_bytes)."""

    @property
    def kept_bytes(self) -> int:
        return self.activation_bytes - self.transient_bytes


def kept_and_transient(blocks: list[BlockCost], choices: tuple[str, ...]) -> tuple[int, int]:
    """(every block's kept bytes, the largest transient) of `choices`."""
    idx = [CHOICES.index(c) for c in choices]
    return sum(b.bytes[i] for b, i in zip(blocks, idx)), max(b.transient[i] for b, i in zip(blocks, idx))


def activation_bytes(blocks: list[BlockCost], choices: tuple[str, ...]) -> int:
    """What `choices` need: every block's kept bytes, plus the largest transient."""
    return sum(kept_and_transient(blocks, choices))


Room = int | Callable[[int], int]
"""What fits: an int = the most kept bytes + largest transient; a function = the most kept bytes given the
largest transient (the estimator's peak is not a plain sum of the two: memory.estimate_memory)."""


def _cap(room: Room, transient: int) -> int:
    """The most kept bytes `room` allows beside a largest transient of `transient` bytes."""
    return room(transient) if callable(room) else room - transient


def _plan(blocks: list[BlockCost], choices: tuple[str, ...], exact: bool = True) -> BlockPlan:
    kept, transient = kept_and_transient(blocks, choices)
    return BlockPlan(choices, kept + transient, plan_seconds(blocks, choices), exact, transient)


def plan_seconds(blocks: list[BlockCost], choices: tuple[str, ...]) -> float:
    total = 0.0
    for b, c in zip(blocks, choices):  # summed in block order, as the dynamic programme does
        total += b.seconds[CHOICES.index(c)]
    return total


def brute_force(blocks: list[BlockCost], room: Room, allowed: tuple[str, ...] = CHOICES) -> BlockPlan | None:
    """Every combination; the least seconds, then the least bytes. For tests and tiny models."""
    best = None
    for choices in itertools.product(allowed, repeat=len(blocks)):
        kept, transient = kept_and_transient(blocks, choices)
        if kept > _cap(room, transient):
            continue
        key = (plan_seconds(blocks, choices), kept + transient)
        if best is None or key < best[0]:
            best = (key, choices)
    return None if best is None else _plan(blocks, best[1])


def _dp(blocks: list[BlockCost], allowed: list[list[int]], room: int,
        max_units: int = MAX_UNITS) -> tuple[tuple[str, ...], bool] | None:
    weights = [b.bytes[c] for b, a in zip(blocks, allowed) for c in a]
    # Sums of multiples of the gcd fit the room exactly when they fit its largest multiple of the gcd.
    quantum = max(1, math.gcd(*weights))
    exact = room // quantum <= max_units
    if not exact:
        quantum = -(-room // max_units)
    units = room // quantum
    best = np.full(units + 1, np.inf)
    best[0] = 0.0
    picks = np.full((len(blocks), units + 1), -1, dtype=np.int8)
    for i, (b, options) in enumerate(zip(blocks, allowed)):
        new = np.full(units + 1, np.inf)
        for c in options:
            w = -(-b.bytes[c] // quantum)
            if w > units:
                continue
            cand = np.full(units + 1, np.inf)
            cand[w:] = best[: units + 1 - w] + b.seconds[c]
            better = cand < new
            new[better] = cand[better]
            picks[i, better] = c
        best = new
    if not np.isfinite(best).any():
        return None
    u = int(np.argmin(best))  # the least seconds; among equal ones the fewest units
    choices = []
    for i in range(len(blocks) - 1, -1, -1):
        c = int(picks[i, u])
        choices.append(CHOICES[c])
        u -= -(-blocks[i].bytes[c] // quantum)
    return tuple(reversed(choices)), exact


def solve(blocks: list[BlockCost], room: Room, allowed: tuple[str, ...] = CHOICES,
          max_units: int = MAX_UNITS) -> BlockPlan | None:
    """The plan with the least added seconds that fits `room` (None: nothing fits), using only the
    `allowed` choices (`max_units`: the memory axis's largest size, see the module docstring)."""
    best: BlockPlan | None = None
    ok = [CHOICES.index(c) for c in allowed]
    for largest in sorted({t for b in blocks for c, t in enumerate(b.transient) if c in ok}):
        cap = _cap(room, largest)
        if cap < 0:
            continue
        options = [[c for c in ok if b.transient[c] <= largest] for b in blocks]
        if not all(options):
            continue
        found = _dp(blocks, options, cap, max_units)
        if found is None:
            continue
        choices, exact = found
        plan = _plan(blocks, choices, exact)
        if best is None or (plan.seconds, plan.activation_bytes) < (best.seconds, best.activation_bytes):
            best = plan
    return best


def least_kept(blocks: list[BlockCost], allowed: tuple[str, ...] = CHOICES) -> list[tuple[int, int]]:
    """(the fewest kept bytes, largest transient) of the `allowed` choices, for each largest transient some
    plan can have."""
    ok = [CHOICES.index(c) for c in allowed]
    pairs = []
    for largest in sorted({t for b in blocks for c, t in enumerate(b.transient) if c in ok}):
        options = [[c for c in ok if b.transient[c] <= largest] for b in blocks]
        if all(options):
            pairs.append((sum(min(b.bytes[c] for c in o) for b, o in zip(blocks, options)), largest))
    return pairs


def offloaded_bytes(blocks: list[BlockCost], choices: tuple[str, ...]) -> int:
    """Bytes a plan's offloaded blocks hold on the offload tier (pinned host memory on CUDA): offload moves
    what keep would keep (the block's saved tensors), full_offload what full keeps (its input), for every
    microbatch in flight (as BlockCost.bytes counts them)."""
    keep, full = CHOICES.index("keep"), CHOICES.index("full")
    return sum(b.bytes[keep] if c == "offload" else b.bytes[full] if c == "full_offload" else 0
               for b, c in zip(blocks, choices))


def this_machine_host_bytes() -> int:
    """This machine's RAM (os.sysconf: physical pages x page size)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What a plan puts in one node's host memory, against that node's RAM."""

    per_rank: int
    """Bytes per rank: on CUDA the offloaded activations (pinned) and CPU-offloaded state; on CPU the rank."""
    ranks_per_node: int
    limit: int | None
    """The node's RAM in bytes; None: unchecked (planning for another machine without --memory.host_gib)."""
    source: str
    """Where the limit comes from, for the line."""
    what: str = "offloaded activations"

    @property
    def per_node(self) -> int:
        return self.per_rank * self.ranks_per_node

    @property
    def fits(self) -> bool:
        return self.limit is None or self.per_node <= self.limit

    def line(self) -> str:
        of = f"of {self.limit / 2**30:.1f} GiB ({self.source})" if self.limit is not None else f"({self.source})"
        return (f"host memory per node: {self.per_node / 2**30:.1f} GiB ({self.per_rank / 2**30:.2f} GiB per rank "
                f"of {self.what} x {self.ranks_per_node} ranks per node) {of}")

    def check(self) -> None:
        if not self.fits:
            raise ValueError(
                f"the memory plan needs more host memory than the node has: {self.line()}; give the node's real "
                f"RAM with --memory.host_gib, offload fewer blocks (--memory.plan_choices keep,op,full), raise "
                f"--memory.budget_gib or shard over more nodes")


def host_limit(host_gib: float, this_machine: bool) -> tuple[int | None, str]:
    """(the node's RAM in bytes or None, its source): --memory.host_gib; else this machine's when the plan is
    for it; else unchecked."""
    if host_gib:
        return int(host_gib * 2**30), "--memory.host_gib"
    if this_machine:
        return this_machine_host_bytes(), "this machine's RAM"
    return None, "unchecked: give --memory.host_gib, the target node's RAM"


def least_bytes(blocks: list[BlockCost], allowed: tuple[str, ...] = CHOICES) -> int:
    """The fewest activation bytes (kept + largest transient) any plan of the `allowed` choices needs."""
    return min(kept + t for kept, t in least_kept(blocks, allowed))


# ---- from a job to block costs ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What `--memory.budget_gib` resolves to, and what the planner predicts for it."""

    budget_bytes: int
    plan: BlockPlan
    choices: tuple[str, ...]
    """One per block of the model (every pipeline stage uses its positions' choices)."""
    memory: MemoryEstimate
    step_seconds: float
    """Predicted step: forward + backward of the rank's blocks and output, plus what the plan adds."""
    base_seconds: float
    bandwidth: float
    """Offload tier bytes/s used."""
    prefetch: bool = True
    """Offload with prefetch (--memory.offload_prefetch)."""
    offload_optimizer: bool = False
    """The optimizer state is offloaded (--memory.offload_optimizer)."""
    on_gpu: bool = False
    host: HostMemory | None = None
    """What the plan puts in a node's host memory (checked against the node's RAM by plan_budget)."""

    def summary(self) -> str:
        runs, prev = [], None
        for i, c in enumerate(self.choices):
            if c != prev:
                runs.append([i, i, c])
                prev = c
            else:
                runs[-1][1] = i
        blocks = ", ".join(f"{a}-{b} {c}" if a != b else f"{a} {c}" for a, b, c in runs)
        note = "" if self.plan.exact else " (memory axis coarsened: see planning/memory_budget.py)"
        return (f"memory plan for a budget of {self.budget_bytes / 2**30:.2f} GiB per rank: blocks {blocks}"
                + ("" if self.prefetch else " (offload without prefetch)")
                + ("; optimizer state offloaded to files" if self.offload_optimizer else "") +
                f"; predicted peak {self.memory.peak / 2**30:.3f} GiB, predicted step {self.step_seconds:.3f} s "
                f"({self.base_seconds:.3f} s without recompute or offload, +{self.step_seconds - self.base_seconds:.3f} s){note}"
                + (f"; GPU memory per rank {self.memory.peak / 2**30:.1f} GiB, {self.host.line()}" if self.host else ""))


def _rank_state_bytes(model: torch.nn.Module, pd, optimizer: str) -> StateBytes:
    """Parameter, gradient and optimizer bytes of the first pipeline rank, the parameters spread evenly over
    the FSDP and TP ranks (the dry run builds each rank for exact figures)."""
    def nbytes(ps) -> int:
        return sum(p.numel() * p.element_size() for p in ps)

    layers = list(model.layers.values())
    blocks = nbytes(p for b in layers for p in b.parameters())
    rest = nbytes(model.parameters()) - blocks
    if pd.pp > 1:  # the first rank: its share of the blocks and the embedding
        emb = getattr(model, "tok_embeddings", None)
        rest = nbytes(emb.parameters()) if emb is not None else 0
    shard = (pd.dp_shard * pd.cp if pd.fsdp_enabled else 1) * pd.tp
    params = int((blocks / pd.pp + rest) / shard)
    states = 2 if optimizer in ("Adam", "AdamW") else 1
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return StateBytes(params, params, states * params, buffers)


def _budget_work(cfg, plan, shape: ModelShape, on_gpu: bool) -> RankWork:
    pd = plan.parallel_dims
    n_blocks = len(plan.model.layers)
    return rank_work(cfg, pd, plan.grad_accum, blocks=n_blocks // pd.pp, holds_embedding=True,
                     holds_output=pd.pp == 1, shape=shape, pp_rank=0, on_gpu=on_gpu)


def block_costs(shape: ModelShape, work: RankWork, seq_len: int, microbatches: int, flops: float,
                bandwidth: float, prefetch: bool = True) -> tuple[list[BlockCost], float, float]:
    """(costs of the rank's blocks, one block's forward seconds per microbatch, the output's) for `work`,
    with offload's prefetch on (two groups resident, moves overlapped) or off (one, moves exposed)."""
    w = work
    tokens = w.tokens_per_microbatch / w.cp
    q_dim = shape.q_dim or shape.dim
    forward = tokens * (2 * shape.block_params + 2 * seq_len * q_dim) / w.tp / flops
    output = tokens * 2 * shape.dim * shape.vocab / w.tp / flops if w.holds_output else 0.0
    group, op, full = (int(tokens * block_elems_per_token(shape, c, w.tp) * w.act_bytes)
                       for c in ("none", "op", "full"))
    kept = (int(group * w.in_flight), int(op * w.in_flight), int(full * w.in_flight), 0, 0)
    # Recomputation rebuilds, during the block's backward, what keep would have kept and the choice did not;
    # full_offload's input comes back for it (its own group, never prefetched: one group in RAM).
    transient = (0, group - op, group - full, (RESIDENT_GROUPS if prefetch else 1) * group, group)
    move = group / bandwidth
    costs = []
    for i in range(w.blocks):
        overlap = forward if i + 1 < w.blocks else output
        offload = max(0.0, move - overlap) + max(0.0, move - 2 * overlap) if prefetch else 2 * move
        # full_offload: the recompute, and its input written (the forward waits) and read back (the
        # recompute waits) in full.
        seconds = (0.0, OP_RECOMPUTE_FRACTION * forward, forward, offload, forward + 2 * full / bandwidth)
        costs.append(BlockCost(kept, tuple(microbatches * x for x in seconds), transient))
    return costs, forward, output


def _peak(shape, state, work, kept: int, transient: int = 0) -> MemoryEstimate:
    return estimate_memory(shape, state, dataclasses.replace(work, block_activation_bytes=kept,
                                                             block_transient_bytes=transient))


def plan_memory(shape, state, work, plan: BlockPlan) -> MemoryEstimate:
    """The estimated peak of a per-block plan."""
    return _peak(shape, state, work, plan.kept_bytes, plan.transient_bytes)


def activation_room(shape, state, work, budget: int) -> Callable[[int], int]:
    """room(T) = the most kept block bytes whose estimated peak, beside a largest transient of T bytes, is
    within `budget` (-1: none). The peak is monotone in both (planning/memory.py), so: bisection."""
    @functools.lru_cache(maxsize=None)
    def room(transient: int) -> int:
        if _peak(shape, state, work, 0, transient).peak > budget:
            return -1
        lo, hi = 0, 1
        while _peak(shape, state, work, hi, transient).peak <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _peak(shape, state, work, mid, transient).peak <= budget else (lo, mid)
        return lo
    return room


@dataclasses.dataclass(frozen=True)
class _Inputs:
    shape: ModelShape
    state: StateBytes
    work: RankWork
    microbatches: int
    flops: float
    """Achieved FLOP/s (peak x mfu)."""
    bandwidth: float
    offloaded: StateBytes | None = None
    """The state bytes with the optimizer state offloaded (RESIDENT_CHUNKS chunks in RAM), or None when the
    job cannot offload it (not in --memory.plan_choices, CUDA, checkpointing, Muon)."""
    optimizer_seconds: float = 0.0
    """What offloading the optimizer state adds to a step: its bytes written and read back once."""

    def costs(self, seq_len: int, prefetch: bool):
        return block_costs(self.shape, self.work, seq_len, self.microbatches, self.flops, self.bandwidth, prefetch)

    def states(self) -> list[tuple[StateBytes, bool]]:
        """(state bytes, optimizer offloaded) for each way the optimizer state may be kept."""
        return [(self.state, False)] + ([(self.offloaded, True)] if self.offloaded is not None else [])

    def least_peak(self, seq_len: int, allowed: tuple[str, ...]) -> int:
        allowed = tuple(c for c in allowed if c in CHOICES)  # "optimizer" is self.offloaded
        pairs = [p for pre in (True, False) for p in least_kept(self.costs(seq_len, pre)[0], allowed)]
        return min(_peak(self.shape, state, self.work, kept, t).peak for state, _ in self.states() for kept, t in pairs)


def _inputs(cfg, plan, flops: float | None, on_gpu: bool | None, mfu: float) -> _Inputs:
    shape = ModelShape.from_args(plan.model_args)
    if shape is None:
        raise ValueError(f"--memory.budget_gib plans with the memory estimator's dense-block formulas, which "
                         f"model {cfg.model.name!r} does not declare (BaseModelArgs.transformer_shape); use "
                         f"--memory.block_choices instead")
    pd = plan.parallel_dims
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda" if on_gpu is None else on_gpu
    if flops is None:
        from torchtitan.tools.device_peak import peak_flops

        flops = peak_flops(device, plan.precision.mixed)
    state = _rank_state_bytes(plan.model, pd, cfg.optimizer.name)
    work = _budget_work(cfg, plan, shape, on_gpu)
    microbatches = plan.grad_accum * (cfg.training.local_batch_size // cfg.parallelism.pipeline_parallel_microbatch_size
                                      if pd.pp > 1 else 1)
    gbps = cfg.memory.offload_bandwidth_gbps or (OFFLOAD_BANDWIDTH_CUDA if on_gpu else OFFLOAD_BANDWIDTH_CPU)
    offloaded, optimizer_seconds = None, 0.0
    if ("optimizer" in cfg.memory.plan_choices and not on_gpu and not cfg.checkpoint.enable
            and cfg.optimizer.name in ("AdamW", "Adam") and state.optimizer):
        from torchtitan.components.optim.optimizer_offload import RESIDENT_CHUNKS, parameter_chunks

        # The share of the optimizer state of the RESIDENT_CHUNKS consecutive chunks (blocks and top-level
        # modules, in the order they step) that weigh the most: those are in RAM together.
        sizes = [sum(p.numel() * p.element_size() for p in c) for c in parameter_chunks(plan.model)]
        window = max(sum(sizes[i: i + RESIDENT_CHUNKS]) for i in range(max(1, len(sizes) - RESIDENT_CHUNKS + 1)))
        resident = min(state.optimizer, int(state.optimizer * window / sum(sizes)))
        offloaded = dataclasses.replace(state, optimizer=resident)
        optimizer_seconds = 2 * state.optimizer / (gbps * 1e9)
    return _Inputs(shape, state, work, microbatches, flops * mfu, gbps * 1e9, offloaded, optimizer_seconds)


def least_budget(cfg, plan, *, flops: float | None = None, on_gpu: bool | None = None,
                 mfu: float = DEFAULT_MFU) -> int:
    """The smallest per-rank peak (bytes) any plan of --memory.plan_choices reaches for this job."""
    return _inputs(cfg, plan, flops, on_gpu, mfu).least_peak(cfg.training.seq_len, tuple(cfg.memory.plan_choices))


def plan_budget(cfg, plan, *, flops: float | None = None, on_gpu: bool | None = None,
                mfu: float = DEFAULT_MFU, ranks_per_node: int | None = None,
                this_machine: bool = True) -> BudgetPlan | None:
    """The per-block plan for `cfg.memory.budget_gib` of a job judged by plan_job (None without a budget).
    `flops` = the device's peak FLOP/s (default: this machine's, tools/device_peak); `on_gpu` the target
    (default: this machine). `ranks_per_node` (default: the world over $NNODES nodes) x what each rank puts
    in host memory must fit a node's RAM (--memory.host_gib, else this machine's when `this_machine`).
    Raises ValueError with one line when the budget or the host memory cannot be met."""
    mem = cfg.memory
    if not mem.budget_gib:
        return None
    budget = int(mem.budget_gib * 2**30)
    x = _inputs(cfg, plan, flops, on_gpu, mfu)
    if x.state.params > budget:
        raise ValueError(f"--memory.budget_gib {mem.budget_gib} is below this rank's own parameters "
                         f"({x.state.params / 2**30:.4f} GiB): raise it or shard the model over more ranks "
                         f"(FSDP/TP/PP)")
    allowed = tuple(c for c in mem.plan_choices if c in CHOICES)
    found, prefetch, best = None, True, None
    # Optimizer state kept or offloaded (when allowed); offload with prefetch (moves hidden, two groups in
    # RAM) or without (one): the plan with the least added seconds of all.
    for state, optimizer_offloaded in x.states():
        room = activation_room(x.shape, state, x.work, budget)
        extra = x.optimizer_seconds if optimizer_offloaded else 0.0
        for pre in (True, False):
            costs, forward, output = x.costs(cfg.training.seq_len, pre)
            candidate = solve(costs, room, allowed)
            if candidate is None:
                continue
            key = (candidate.seconds + extra, candidate.activation_bytes)
            if best is None or key < best[0]:
                best = (key, state, optimizer_offloaded)
                found, prefetch = candidate, pre
    if found is None:
        least = x.least_peak(cfg.training.seq_len, allowed)
        raise ValueError(f"--memory.budget_gib {mem.budget_gib} cannot be met: the least any plan of "
                         f"{'/'.join(allowed)} per block needs is {math.ceil(least / 2**30 * 1e4) / 1e4:.4f} GiB "
                         f"per rank; raise the budget to that, shard more or lower --training.local_batch_size"
                         + ("" if {"offload", "full_offload"} <= set(allowed)
                            else " (or allow offload and full_offload in --memory.plan_choices)"))
    pd = plan.parallel_dims
    choices = tuple(list(found.choices) * pd.pp)[: len(plan.model.layers)]
    base = 3 * x.microbatches * (x.work.blocks * forward + output)
    (seconds, _), state, optimizer_offloaded = best
    memory = plan_memory(x.shape, state, x.work, found)
    if x.work.on_gpu:  # pinned host buffers of the offloaded blocks, and FSDP's CPU-offloaded state
        costs = x.costs(cfg.training.seq_len, prefetch)[0]
        on_host, what = offloaded_bytes(costs, found.choices), "offloaded activations"
        if cfg.training.enable_cpu_offload:
            on_host += state.params + state.grads + state.optimizer
            what += " and CPU-offloaded parameters, gradients and optimizer state"
    else:  # the device is the host: the whole rank (its offload tier is files)
        on_host, what = memory.peak, "the rank's predicted peak"
    if ranks_per_node is None:
        ranks_per_node = max(1, pd.world_size // max(1, int(os.environ.get("NNODES", "1"))))
    host = HostMemory(on_host, ranks_per_node, *host_limit(cfg.memory.host_gib, this_machine), what)
    host.check()
    return BudgetPlan(budget, found, choices, memory, base + seconds, base, x.bandwidth,
                      prefetch or "offload" not in found.choices, optimizer_offloaded, x.work.on_gpu, host)


def resolve_budget(cfg, world_size: int):
    """(the job config the trainer runs, the budget's plan or None): with `--memory.budget_gib`, the plan's
    per-block choices become `--memory.block_choices` (and the budget 0), so the trainer, its saved
    config.toml and a resumed run apply exactly this plan. Raises the one-line errors of plan_job and
    plan_budget."""
    from torchtitan.job_plan import plan_job

    if not cfg.memory.budget_gib:
        return cfg, None
    budget = plan_budget(cfg, plan_job(cfg, world_size))
    # On CPU the budget bounds resident memory, so glibc must return what is freed (tools/cpu_malloc.py).
    memory = dataclasses.replace(cfg.memory, budget_gib=0.0, block_choices=list(budget.choices),
                                 offload_prefetch=budget.prefetch, offload_optimizer=budget.offload_optimizer,
                                 cpu_return_freed=cfg.memory.cpu_return_freed or not budget.on_gpu)
    return dataclasses.replace(cfg, memory=memory), budget
