"""Dry run: build a job's real mesh, model and parallelisation for chosen ranks of an N-rank world in one
CPU process, and report what each rank would hold.

A fake process group (torch's testing backend "fake": collectives return at once, moving nothing) lets
one process take the place of any rank of any world size. The model is built on the meta device, so
nothing is allocated: parameters are DTensors whose local shards have real shapes, and those shapes are
what the rank would hold. The job is judged by `plan_job` and parallelised by the train spec's own
`parallelize_fn` / `pipelining_fn`, exactly as the trainer does, so a layout the dry run accepts is one
the trainer accepts.

Bytes per rank:
  parameters  local shard sizes of every parameter of the rank's model parts (training.dtype)
  gradients   the same for trainable parameters: FSDP2 keeps sharded gradients in the parameter dtype
  optimizer   Adam/AdamW: exp_avg and exp_avg_sq shaped like each parameter's shard, plus a float32
              `step` per parameter tensor (torch's non-capturable CPU/GPU default); Muon: a momentum
              buffer per Muon matrix (the default rule, components/optim/muon.py), AdamW's states for the rest
  Muon step   the gathered matrices this rank orthogonalises and the Newton-Schulz temporaries of its
              largest (components/optim/muon_distributed.py owner_bytes), in the memory estimate
  buffers     non-parameter tensors of the parts (e.g. the RoPE table), replicated on every rank
"""

import contextlib
import copy
import dataclasses
import time
from collections.abc import Sequence
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan.components.optim.muon import default_is_muon_param, ns_dtype_for
from torchtitan.components.optim.muon_distributed import owner_bytes
from torchtitan.config import JobConfig
from torchtitan.distributed.pipeline import split_backward_recompute
from torchtitan.errors import USER_ERRORS
from torchtitan.job_plan import JobPlan, plan_job
from torchtitan.planning.cp_comm import cp_comm_line
from torchtitan.planning.hardware import Device, headroom_note, memory_limit
from torchtitan.planning.held_out_error import memory_interval_line
from torchtitan.planning.memory import (
    MUON_STEP_COMPONENT,
    MemoryEstimate,
    ModelShape,
    StateBytes,
    ac_key,
    block_elems_per_token,
    estimate_memory,
    rank_work,
)
from torchtitan.planning.memory_budget import BudgetPlan, plan_budget
from torchtitan.protocols.model_shape import base_model_args
from torchtitan.protocols.train_spec import get_train_spec

OPTIMIZER_STATES_PER_PARAM = {"Adam": 2, "AdamW": 2}
"""Tensors shaped like the parameter that each optimizer keeps (besides its scalar step)."""
STEP_BYTES = 4


@dataclasses.dataclass(frozen=True)
class StageContents:
    index: int
    num_stages: int
    modules: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RankReport:
    rank: int
    coordinates: dict[str, int]
    num_params: int
    """Elements of the rank's local parameter shards."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    stages: tuple[StageContents, ...]
    """The pipeline stages this rank holds (empty without pipeline parallel)."""
    memory: MemoryEstimate | None = None
    """Estimated peak memory by component (None when the model has no estimator formula)."""
    muon_largest: str | None = None
    """Muon: the largest matrix this rank orthogonalises whole at the optimizer step, "name [m, n]"."""

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes


@dataclasses.dataclass
class DryRunReport:
    world_size: int
    model: str
    layout: str
    ranks: list[RankReport]
    errors: list[str]
    seconds: float
    plan: JobPlan | None = None
    cp_comm: str | None = None
    """Bytes per rank per attention layer of the configured context-parallel method and its alternatives."""
    budget: BudgetPlan | None = None
    """The per-block memory plan of --memory.budget_gib (None without a budget)."""
    block_kinds: str | None = None
    """Models with several kinds of block (Qwen3.5): what one block of each kind keeps for backward."""
    memory_caveat: str | None = None
    """Where the job sits in a case the memory estimator is known not to model (said beside its figures)."""
    memory_intervals: dict[int, str] = dataclasses.field(default_factory=dict)
    """With a target device, per rank: where published peaks lay beside such estimates for the held-out runs
    (planning/held_out_error.py), flagged when the upper end passes the device's memory."""


def default_ranks(pp: int, world_size: int) -> list[int]:
    """The first rank of every pipeline stage group (pp is the outermost mesh dimension), so the report
    shows every stage; rank 0 alone without pipeline parallel."""
    return [s * (world_size // pp) for s in range(pp)]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int):
    """This process acts as `rank` of a `world_size` world whose collectives do nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a dry run needs a process without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _unused_loss(logits, labels):
    raise RuntimeError("a dry run never runs a training step")


def build_model_parts(plan: JobPlan, cfg: JobConfig) -> tuple[list[nn.Module], list]:
    """The rank's model parts, parallelised the way the trainer does it, and its pipeline stages (empty
    without PP). The one place the dry run calls the train spec's parallelisation."""
    pd = plan.parallel_dims
    model = copy.deepcopy(plan.model)  # parallelising changes a model in place; each rank gets its own copy
    if not pd.pp_enabled:
        return [plan.spec.parallelize_fn(model, pd, cfg)], []
    pipeline = plan.spec.pipelining_fn(model, pd, cfg, torch.device("cpu"), plan.spec.parallelize_fn, _unused_loss)
    schedule = pipeline.schedule
    return pipeline.parts, list(getattr(schedule, "_stages", None) or [schedule._stage])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _stage_shares(stages: list) -> tuple[float, ...] | None:
    """Each of the rank's pipeline stages' share of its trainable parameter elements, in stage order."""
    counts = [sum(_local(p).numel() for p in s.submod.parameters() if p.requires_grad)
              for s in sorted(stages, key=lambda s: s.stage_index)]
    return tuple(n / sum(counts) for n in counts) if len(counts) > 1 and sum(counts) else None


def compress_names(names: Sequence[str]) -> tuple[str, ...]:
    """("tok_embeddings", "layers.0", "layers.1", "layers.2", "norm") -> ("tok_embeddings", "layers.0-2", "norm")."""
    out: list[str] = []
    run: list[int] = []

    def flush():
        if run:
            out.append(f"layers.{run[0]}" if len(run) == 1 else f"layers.{run[0]}-{run[-1]}")
            run.clear()

    for n in names:
        if n.startswith("layers.") and n[7:].isdigit() and (not run or int(n[7:]) == run[-1] + 1):
            run.append(int(n[7:]))
        else:
            flush()
            if n.startswith("layers.") and n[7:].isdigit():
                run.append(int(n[7:]))
            else:
                out.append(n)
    flush()
    return tuple(out)


def part_modules(part: nn.Module) -> list[str]:
    """Top-level modules a model part holds, blocks of `layers` by key."""
    names = []
    for name, child in part.named_children():
        if name == "layers":
            names += [f"layers.{k}" for k in child.keys()]
        elif child is not None:
            names.append(name)
    return names


def _muon_matrices(cfg: JobConfig, parts: list[nn.Module]) -> dict[str, nn.Parameter]:
    """The parameters Muon steps, by FQN, in the optimizer's order (the default rule; none without Muon)."""
    if cfg.optimizer.name != "Muon":
        return {}
    return {name: p for part in parts for name, p in part.named_parameters()
            if p.requires_grad and default_is_muon_param(name, p)}


def muon_step_bytes(muon: dict[str, nn.Parameter], rank: int, opt_cfg, on_gpu: bool) -> tuple[int, str | None]:
    """(bytes, its largest matrix as "name [m, n]") of this rank's Muon step workspace. Matrices are grouped
    by the mesh they are sharded over, as the optimizer does, and each group's owners are `assign_owners`'
    over that group, so the figure is this rank's share, not the whole model's. The groups are done one
    after another, so the workspace is the largest group's."""
    by_mesh: dict[int, list[tuple[str, nn.Parameter]]] = {}
    for name, p in muon.items():
        sharded = isinstance(p, DTensor) and p.device_mesh.size() > 1
        by_mesh.setdefault(id(p.device_mesh) if sharded else -1, []).append((name, p))
    ns_dtype = ns_dtype_for(opt_cfg.muon_ns_dtype, torch.device("cuda" if on_gpu else "cpu"))
    ns_bytes = torch.empty((), dtype=ns_dtype).element_size()
    worst, worst_name = 0, None
    for key, named in by_mesh.items():
        shapes = [tuple(p.shape) for _, p in named]
        elem = _local(named[0][1]).element_size()
        order = named[0][1].device_mesh.mesh.flatten().tolist() if key != -1 else [rank]
        need, idx = owner_bytes(shapes, len(order), order.index(rank), opt_cfg.muon_ns_steps, elem, ns_bytes)
        if need > worst:
            worst, worst_name = need, f"{named[idx][0]} {list(shapes[idx])}"
    return worst, worst_name


def rank_report(
    rank: int, plan: JobPlan, cfg: JobConfig, parts: list[nn.Module], stages: list, on_gpu: bool = False
) -> RankReport:
    params = {id(p): p for part in parts for p in part.parameters()}.values()
    buffers = {id(b): b for part in parts for b in part.buffers()}.values()
    param_bytes = sum(_bytes(p) for p in params)
    trainable = [p for p in params if p.requires_grad]
    grad_bytes = sum(_bytes(p) for p in trainable)
    muon = _muon_matrices(cfg, parts)
    muon_ids = {id(p) for p in muon.values()}
    adam = [p for p in trainable if id(p) not in muon_ids]
    n_states = OPTIMIZER_STATES_PER_PARAM.get(cfg.optimizer.name, 2)
    optimizer_bytes = (n_states * sum(_bytes(p) for p in adam) + STEP_BYTES * len(adam)
                       + sum(_bytes(p) for p in muon.values()))  # Muon: one momentum buffer, no step
    mesh = plan.parallel_dims.world_mesh
    coords = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
    buffer_bytes = sum(_bytes(b) for b in buffers)
    memory, muon_largest = None, None
    shape = ModelShape.from_args(plan.model_args)  # None: the estimator has no formula for this model's blocks
    if shape is not None:
        pp_rank = coords.get("pp", 0)
        work = rank_work(
            cfg, plan.parallel_dims, plan.grad_accum,
            blocks=sum(len(p.layers) for p in parts),
            holds_embedding=any(getattr(p, "tok_embeddings", None) is not None for p in parts),
            holds_output=any(getattr(p, "output", None) is not None for p in parts), shape=shape,
            pp_rank=pp_rank, stages_per_rank=max(1, len(stages)), on_gpu=on_gpu,
            fsdp_shard_params=sum(_local(p).numel() for p in trainable),
            stage_shares=_stage_shares(stages),
        )
        step_bytes, muon_largest = muon_step_bytes(muon, rank, cfg.optimizer, on_gpu)
        state = StateBytes(param_bytes, grad_bytes, optimizer_bytes, buffer_bytes, step_bytes)
        memory = estimate_memory(shape, state, work)
    return RankReport(
        rank=rank,
        coordinates=coords,
        num_params=sum(_local(p).numel() for p in params),
        param_bytes=param_bytes,
        grad_bytes=grad_bytes,
        optimizer_bytes=optimizer_bytes,
        buffer_bytes=buffer_bytes,
        stages=tuple(
            StageContents(s.stage_index, s.num_stages, compress_names(part_modules(s.submod))) for s in stages
        ),
        memory=memory,
        muon_largest=muon_largest if memory is not None else None,
    )


def _over_memory_line(r: RankReport, device: Device, memory_headroom: float) -> str:
    """The one line for a rank whose estimate exceeds the device; it names Muon's step when that is what
    does not fit (the rest of the step would)."""
    limit = memory_limit(device, memory_headroom)
    over = (f"rank {r.rank}: estimated peak memory {r.memory.peak / 2**30:.1f} GiB exceeds the {device.name}'s "
            f"{device.memory_bytes / 2**30:.0f} GiB{headroom_note(memory_headroom)}")
    muon = r.memory.components.get(MUON_STEP_COMPONENT, 0)
    if muon and r.memory.peak - muon <= limit:
        return (f"{over} only at Muon's optimizer step: the matrices this rank orthogonalises whole (largest "
                f"{r.muon_largest}) need {muon / 2**30:.1f} GiB more than backward; more data-parallel ranks "
                f"spread them over more owners, and a matrix too large alone must leave Muon (the train spec's "
                f"is_muon_param) or the job use --optimizer.name AdamW")
    return f"{over}; shard more (FSDP/TP/PP), use --activation_checkpoint.mode full or a smaller local batch"


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def dry_run(
    cfg: JobConfig, world_size: int, ranks: Sequence[int] | None = None, device: Device | None = None,
    memory_headroom: float = 0.0,
) -> DryRunReport:
    """Judges the job for `world_size` ranks and builds the requested ranks (default: see default_ranks).
    With a target `device`, the memory estimate includes the GPU's allocator and runtime overheads and a
    rank whose estimate exceeds its memory, less `memory_headroom` (the planner's option), is an error.
    Every problem found becomes one line of `errors`; a tokenizer file that is missing is reported and the
    flavor's vocabulary used instead, so the layout is still checked."""
    start = time.perf_counter()
    errors: list[str] = []
    tokenizer = None
    try:
        get_train_spec(cfg.model.name).build_tokenizer_fn(cfg)
    except FileNotFoundError as e:
        try:
            vocab = base_model_args(get_train_spec(cfg.model.name), cfg).vocab_size
            errors.append(f"{_one_line(e)} (the dry run goes on with the flavor's vocab_size {vocab})")
            tokenizer = SimpleNamespace(vocab_size=vocab)
        except USER_ERRORS as e2:
            errors.append(_one_line(e2))
    except USER_ERRORS as e:
        errors.append(_one_line(e))
    shape = f"({cfg.model.hf_config})" if cfg.model.hf_config else cfg.model.flavor  # hf_config replaces the flavor
    report = DryRunReport(world_size, f"{cfg.model.name} {shape}", "", [], errors, 0.0)
    try:
        plan = plan_job(cfg, world_size, tokenizer)
    except USER_ERRORS as e:
        if not errors or _one_line(e) not in errors[0]:
            errors.append(_one_line(e))
        report.seconds = time.perf_counter() - start
        return report
    pd = plan.parallel_dims
    report.plan = plan
    try:  # --memory.budget_gib: the per-block plan for the target device (or this machine)
        report.budget = plan_budget(cfg, plan, flops=device.bf16_flops if device else None,
                                    on_gpu=device is not None, this_machine=device is None,
                                    ranks_per_node=min(device.gpus_per_node, world_size) if device else None)
    except USER_ERRORS as e:
        errors.append(_one_line(e))
    report.layout = " x ".join(
        f"{name} {getattr(pd, name)}" for name in ("pp", "dp_replicate", "dp_shard", "cp", "tp") if getattr(pd, name) > 1
    ) or "single rank"
    report.cp_comm = cp_comm_line(cfg, pd, plan.model_args.transformer_shape(), plan.precision.mixed.itemsize)
    report.block_kinds = block_kinds_line(cfg, plan)
    report.memory_caveat = memory_caveat_line(cfg, pd)
    wanted = list(ranks) if ranks is not None else default_ranks(pd.pp, world_size)
    bad = [r for r in wanted if not 0 <= r < world_size]
    if bad:
        errors.append(f"--ranks {bad} outside the world of {world_size} ranks (0..{world_size - 1})")
        wanted = [r for r in wanted if 0 <= r < world_size]
    for rank in wanted:
        try:
            with fake_process_group(rank, world_size):
                pd.build_mesh("cpu")
                parts, stages = build_model_parts(plan, cfg)
                r = rank_report(rank, plan, cfg, parts, stages, on_gpu=device is not None)
                report.ranks.append(r)
                if device is not None and r.memory is not None:
                    report.memory_intervals[rank] = memory_interval_line(r.memory, pd.pp > 1, device.memory_bytes)
                    if r.memory.peak > memory_limit(device, memory_headroom):
                        errors.append(_over_memory_line(r, device, memory_headroom))
        except USER_ERRORS as e:
            line = f"rank {rank}: {_one_line(e)}"
            if line.split(": ", 1)[1] not in [x.split(": ", 1)[-1] for x in errors]:
                errors.append(line)
    report.seconds = time.perf_counter() - start
    return report


def memory_caveat_line(cfg: JobConfig, pd) -> str | None:
    """A split-backward schedule with recomputing AC: the input pass recomputes each block and what it rebuilt
    waits for the weight pass, for a time the estimate does not model (CPU, docs/planning.md: it read 0.66 and
    0.78 of the measured peak), and the weight pass recomputes each block once per weight (torch's
    stage_backward_weight runs one autograd call per parameter group; tests/unit/test_dry_run.py counts them).
    None for every other job."""
    schedule = cfg.parallelism.pipeline_parallel_schedule
    recompute = split_backward_recompute(schedule, cfg.activation_checkpoint) if pd.pp > 1 else None
    if recompute is None:
        return None
    return (f"memory caveat: {schedule} with {ac_key(cfg.activation_checkpoint)} AC recomputes each block in the "
            "input pass and keeps what it rebuilt until the weight pass, which the estimates above do not model "
            f"(measured on CPU: they read 0.66-0.78 of the peak); measure it. Time: {recompute}")


def block_kinds_line(cfg: JobConfig, plan: JobPlan) -> str | None:
    """One line for a model whose blocks differ (planning/memory.py's per-kind formulas): the activations one
    block of each kind keeps for backward per microbatch, under the job's AC, TP and CP. None otherwise."""
    shape = ModelShape.from_args(plan.model_args)
    if shape is None or len(shape.kinds) < 2:
        return None
    w = rank_work(cfg, plan.parallel_dims, plan.grad_accum, blocks=1, holds_embedding=True, holds_output=True,
                  shape=shape)
    tokens = w.tokens_per_microbatch / w.cp
    figures = ", ".join(
        f"{kind} x{n} {block_elems_per_token(shape, w.ac, w.tp, kind) * tokens * w.act_bytes / 2**20:,.1f} MiB"
        for kind, n in shape.kinds.items())
    return f"activations kept per block and microbatch (AC {w.ac}): {figures}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def format_report(report: DryRunReport) -> str:
    lines = [f"dry run: {report.model} on {report.world_size} ranks ({report.layout or 'not built'}), "
             f"{report.seconds:.1f} s"]
    if report.ranks:
        lines.append(f"{'rank':>6}  {'coordinates':<28} {'params':>14} {'param GiB':>10} {'grad GiB':>9} "
                     f"{'optim GiB':>10} {'buffer GiB':>10} {'total GiB':>10}")
        for r in report.ranks:
            coords = " ".join(f"{k}={v}" for k, v in r.coordinates.items())
            lines.append(
                f"{r.rank:>6}  {coords:<28} {r.num_params:>14,} {_gib(r.param_bytes):>10} {_gib(r.grad_bytes):>9} "
                f"{_gib(r.optimizer_bytes):>10} {_gib(r.buffer_bytes):>10} {_gib(r.model_state_bytes):>10}"
            )
        for r in report.ranks:
            for s in r.stages:
                lines.append(f"rank {r.rank} holds stage {s.index} of {s.num_stages}: {', '.join(s.modules)}")
        for r in report.ranks:
            if r.memory is not None:
                lines.append(f"estimated peak memory of rank {r.rank}:\n{r.memory.table()}")
                if r.rank in report.memory_intervals:
                    lines.append(f"  {report.memory_intervals[r.rank]}")
    if report.block_kinds:
        lines.append(report.block_kinds)
    if report.memory_caveat:
        lines.append(report.memory_caveat)
    if report.cp_comm:
        lines.append(report.cp_comm)
    if report.budget is not None:
        lines.append(report.budget.summary())
    lines += [f"error: {e}" for e in report.errors] or ["no validation errors"]
    return "\n".join(lines)
