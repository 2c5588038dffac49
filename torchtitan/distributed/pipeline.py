"""Pipeline parallelism: cut a model into stages, place them on the "pp" ranks, run a torch schedule.

    plan_pipeline (pure: config + module order ─▶ which modules each stage holds, microbatch count)
    ─▶ split_stage (meta model ─▶ one stage: modules it does not hold are deleted or set to None)
    ─▶ parallelize_fn per stage (the same TP/FSDP composition as a whole model)
    ─▶ PipelineStage per local stage ─▶ schedule from torch.distributed.pipelining

A stage keeps the parameter names of the whole model (layers stay keyed by their original index), so
checkpoints move between pipelined and non-pipelined runs.

Placement: loop-style schedules put stage s on pp rank s % pp; V-shaped ones (ZBVZeroBubble, DualPipeV)
put stages r and 2*pp-1-r on rank r, so rank 0 holds both the first and the last stage.

Loss scaling: `Pipeline.step` takes the step's global token count as an argument and the schedule's loss
divides each microbatch's summed token loss by it, so gradients summed over microbatches are the step's
mean. The schedules are therefore built with scale_grads=False; torch's default (True) would divide the
gradients by n_microbatches a second time. `Pipeline.eval` uses the plain sum.

Gradient accumulation: one schedule step consumes one local batch (local_batch_size sequences split into
local_batch_size / pipeline_parallel_microbatch_size microbatches); when global_batch_size asks for more
sequences per rank, the trainer runs several schedule steps before the optimizer step. Each schedule step
ends with its own FSDP reduce-scatter (torch's schedule drives FSDP's gradient sync itself); FSDP adds
the reduced shards to the gradients already there, so the sum over schedule steps is exact.
"""

import contextlib
import copy
import dataclasses
import difflib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _ComputationType,
    _PipelineSchedule,
    _PipelineScheduleRuntime,
    get_schedule_class,
)

from torchtitan.components.loss import first_label_slot, loss_value, per_source_loss_sums, token_and_mtp_loss
from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.distributed.balance import InfeasibleSplit, balanced_split, module_flops
from torchtitan.protocols.model import is_shape_only_forward, mtp_settings, shape_only_forward, split_inputs

# Schedules by how many stages each rank holds and where they sit.
SINGLE_STAGE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE_STAGE + LOOPED + V_SHAPED
# Schedules that split backward into an input pass and a later weight pass.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    schedule: str
    """Canonical schedule name (one of SCHEDULES)."""
    pp: int
    stages: tuple[tuple[str, ...], ...]
    """Module names each stage holds, in pipeline order (e.g. ("tok_embeddings", "layers.0"))."""
    n_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    def rank_of(self, stage: int) -> int:
        if self.schedule in V_SHAPED:
            return stage if stage < self.pp else self.num_stages - 1 - stage
        return stage % self.pp

    def local_stages(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.rank_of(s) == pp_rank]


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name (matching is case-insensitive)."""
    by_lower = {s.lower(): s for s in SCHEDULES}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    near = difflib.get_close_matches(name, SCHEDULES, n=2) or list(SCHEDULES)
    raise LayoutError(
        f"unknown pipeline schedule {name!r} (--parallelism.pipeline_parallel_schedule); try: {', '.join(near)}"
    )


def module_order(model: nn.Module, head: Sequence[str], tail: Sequence[str]) -> list[str]:
    """Names of the modules a pipeline is cut between: head modules, every block of `model.layers`
    (by its key), tail modules."""
    return [*head, *(f"layers.{k}" for k in model.layers.keys()), *tail]


def _stage_sizes(units: int, num_stages: int) -> list[int]:
    """Splits `units` as evenly as possible; the remainder goes to the stages after the first, because
    under 1F1B-like schedules the first stage keeps the most microbatches' activations in flight."""
    base, extra = divmod(units, num_stages)
    return [base + (1 if 1 <= s <= extra else 0) for s in range(num_stages)]


def split_by_compute(
    order: Sequence[str],
    n_head: int,
    n_tail: int,
    num_stages: int,
    first_less: int,
    last_less: int,
    sizes: Sequence[int] | None = None,
) -> list[list[str]]:
    """Distributes the blocks of `order` over `num_stages` stages: the head modules go to the first stage
    and count as `first_less` blocks of compute, the tail modules to the last stage counting as
    `last_less` blocks. `sizes` (blocks of compute per stage) defaults to an even split."""
    layers = list(order[n_head : len(order) - n_tail])
    units = len(layers) + first_less + last_less
    sizes = list(sizes) if sizes is not None else _stage_sizes(units, num_stages)
    counts = list(sizes)
    counts[0] -= first_less
    counts[-1] -= last_less
    stages, start = [], 0
    for c in counts:
        stages.append(layers[start : start + max(c, 0)])
        start += max(c, 0)
    stages[0] = list(order[:n_head]) + stages[0]
    stages[-1] = stages[-1] + list(order[len(order) - n_tail :])
    if min(counts) < 0 or not all(stages):
        raise LayoutError(
            f"{len(layers)} transformer layers (+{first_less} for the embedding, +{last_less} for the output) "
            f"cannot fill {num_stages} pipeline stages; use fewer stages (pipeline_parallel_degree / a schedule "
            f"with fewer stages per rank), a smaller --parallelism.pipeline_parallel_first_stage_less_layers / "
            f"last_stage_less_layers, or a deeper model"
        )
    return stages


def check_explicit_split(fqns_per_stage: Sequence[Sequence[str]], order: Sequence[str]) -> None:
    """The stages, read in order, must list every module of `order` exactly once and in model order."""
    flat = [name for stage in fqns_per_stage for name in stage]
    empty = [i for i, stage in enumerate(fqns_per_stage) if not stage]
    unknown = [n for n in flat if n not in order]
    problem = None
    if empty:
        problem = f"stage(s) {empty} hold no modules"
    elif unknown:
        problem = f"unknown module(s) {unknown}; this model's modules are {order[0]} .. {order[-1]}"
    elif len(set(flat)) != len(flat):
        problem = f"module(s) {sorted({n for n in flat if flat.count(n) > 1})} listed more than once"
    elif flat != list(order):
        missing = [n for n in order if n not in flat]
        problem = f"module(s) {missing} missing" if missing else "modules are not in model order"
    if problem:
        raise LayoutError(
            f"--parallelism.module_fqns_per_model_part: {problem}; the stages, read in order, must list "
            f"{', '.join(order)} each exactly once"
        )


def _check_stage_count(schedule: str, num_stages: int, pp: int, how: str) -> None:
    per_rank, rem = divmod(num_stages, pp)
    if rem:
        raise LayoutError(f"{how} gives {num_stages} pipeline stages, not a multiple of pipeline_parallel_degree {pp}")
    if schedule in SINGLE_STAGE and per_rank != 1:
        raise LayoutError(
            f"{schedule} runs one stage per rank but {how} gives {per_rank} per rank; use Interleaved1F1B, "
            f"LoopedBFS or InterleavedZeroBubble for several stages per rank"
        )
    if schedule in LOOPED and per_rank < 2:
        raise LayoutError(
            f"{schedule} needs at least 2 stages per rank but {how} gives {per_rank}; use 1F1B or GPipe for one "
            f"stage per rank"
        )
    if schedule in V_SHAPED and per_rank != 2:
        raise LayoutError(f"{schedule} needs exactly 2 stages per rank (V shape) but {how} gives {per_rank}")


def _check_microbatches(schedule: str, n: int, pp: int, num_stages: int, how: str) -> None:
    if schedule in V_SHAPED and n < num_stages:
        raise LayoutError(
            f"{schedule} needs at least 2 x pipeline_parallel_degree = {num_stages} microbatches but {how} gives "
            f"{n}; raise --training.local_batch_size or lower --parallelism.pipeline_parallel_microbatch_size"
        )
    if schedule != "GPipe" and n < pp:
        raise LayoutError(
            f"{schedule} needs at least pipeline_parallel_degree = {pp} microbatches but {how} gives {n}; raise "
            f"--training.local_batch_size or lower --parallelism.pipeline_parallel_microbatch_size"
        )
    # Interleaved schedules run rounds of n // pp microbatches, which must divide n evenly.
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble") and n % max(1, n // pp):
        raise LayoutError(
            f"{schedule} runs rounds of microbatches // pipeline_parallel_degree = {n // pp}, which must divide "
            f"the microbatch count, but {how} gives {n}; a multiple of {pp} works, e.g. {n // pp * pp}"
        )


def plan_pipeline(
    p, order: Sequence[str], n_head: int, n_tail: int, local_batch_size: int, costs: Sequence[float] | None = None
) -> PipelinePlan:
    """Checks a pipeline layout and decides the stages and microbatch count; one LayoutError when it
    cannot work. `p` is the Parallelism config section, `order` the model's module_order, `costs` the
    modules' compute (needed by pipeline_parallel_split "balanced")."""
    pp = p.pipeline_parallel_degree
    schedule = schedule_name(p.pipeline_parallel_schedule)
    n_layers = len(order) - n_head - n_tail
    first_less, last_less = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    if first_less < 0 or last_less < 0:
        raise LayoutError("pipeline_parallel_first_stage_less_layers / last_stage_less_layers must be >= 0")
    if p.module_fqns_per_model_part is not None:
        check_explicit_split(p.module_fqns_per_model_part, order)
        stages = [list(s) for s in p.module_fqns_per_model_part]
        _check_stage_count(schedule, len(stages), pp, "--parallelism.module_fqns_per_model_part")
    elif p.pipeline_parallel_layers_per_stage is not None:
        per = p.pipeline_parallel_layers_per_stage
        units = n_layers + first_less + last_less
        if per < 1 or units % per:
            fits = [d for d in range(1, units + 1) if units % d == 0 and (units // d) % pp == 0]
            raise LayoutError(
                f"--parallelism.pipeline_parallel_layers_per_stage {per} must divide {n_layers} layers + "
                f"{first_less} (embedding) + {last_less} (output) = {units}; values that fit pp {pp}: {fits}"
            )
        num_stages = units // per
        _check_stage_count(schedule, num_stages, pp, f"pipeline_parallel_layers_per_stage {per}")
        stages = split_by_compute(order, n_head, n_tail, num_stages, first_less, last_less, [per] * num_stages)
    else:
        per_rank = 1 if schedule in SINGLE_STAGE else 2
        if p.pipeline_parallel_split == "balanced":
            stages = _balanced_stages(order, costs, pp * per_rank)
        else:
            stages = split_by_compute(order, n_head, n_tail, pp * per_rank, first_less, last_less)

    mbs = p.pipeline_parallel_microbatch_size
    if mbs < 1 or local_batch_size % mbs:
        raise LayoutError(
            f"--training.local_batch_size {local_batch_size} is not a multiple of "
            f"--parallelism.pipeline_parallel_microbatch_size {mbs}"
        )
    n = local_batch_size // mbs
    _check_microbatches(schedule, n, pp, len(stages), f"local_batch_size {local_batch_size} / microbatch size {mbs}")
    return PipelinePlan(schedule, pp, tuple(tuple(s) for s in stages), n)


def _balanced_stages(order: Sequence[str], costs: Sequence[float] | None, num_stages: int) -> list[list[str]]:
    if costs is None or len(costs) != len(order):
        raise ValueError("pipeline_parallel_split 'balanced' needs one cost per module of the pipeline order")
    try:
        sizes = balanced_split(costs, num_stages)
    except InfeasibleSplit as e:
        raise LayoutError(f"--parallelism.pipeline_parallel_split balanced: {e}") from None
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [list(order[a : a + n]) for a, n in zip(starts, sizes)]


def split_stage(model: nn.Module, keep: Sequence[str], head: Sequence[str], tail: Sequence[str]) -> nn.Module:
    """A copy of the (meta) model holding only the modules named in `keep`: other blocks are deleted from
    `model.layers`, other head/tail modules set to None. Parameter names stay those of the whole model."""
    stage = copy.deepcopy(model)
    for key in list(stage.layers.keys()):
        if f"layers.{key}" not in keep:
            del stage.layers[key]
    for name in (*head, *tail):
        if name not in keep:
            setattr(stage, name, None)
    return stage


class _Stage(PipelineStage):
    """A PipelineStage whose shape-inference forward (run on the first microbatch or placeholder data) is
    marked as such, so the model skips side effects there (see protocols.model.shape_only_forward)."""

    def _compute_outputs(self, *args, module, **kwargs):
        with shape_only_forward():
            return super()._compute_outputs(*args, module=module, **kwargs)

    def _prepare_backward_infra(self, *args, **kwargs):
        # The last stage's metadata inference calls the loss on the first microbatch's target.
        with shape_only_forward():
            return super()._prepare_backward_infra(*args, **kwargs)


class _DivisorLoss:
    """The schedule's loss: the model's summed token loss over a divisor that `Pipeline` sets for the
    duration of one schedule call (torch's schedules take the loss function once, at construction).

    For a mixture's per-source loss, `Pipeline` also sets `source_sums` ([2, sources] zeros) and passes
    the labels and source ids stacked on a last dimension as the schedule's target, so the schedule splits
    both into the same microbatches; each microbatch's loss adds its per-source token-loss sums and token
    counts into `source_sums`.

    A model with multi-token prediction returns (logits, *mtp_logits) from its last stage in training: their
    loss is added with the model's weight (components/loss.py token_and_mtp_loss), and each microbatch's
    per-depth loss sums and token counts are added into `mtp_sums` ([2, D] zeros, set by `Pipeline`)."""

    def __init__(self, loss_fn: Callable, mtp_weight: float = 0.0):
        self.loss_fn = loss_fn
        self.mtp_weight = mtp_weight
        self.divisor: torch.Tensor | float = 1.0
        self.source_sums: torch.Tensor | None = None
        self.mtp_sums: torch.Tensor | None = None

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
        logits, *mtp_logits = output if isinstance(output, tuple) else (output,)
        labels = target
        counted = not is_shape_only_forward()  # not the metadata inference's extra call on microbatch 0
        if self.source_sums is not None:
            labels, source_ids = target.unbind(-1)
            if counted:
                self.source_sums += per_source_loss_sums(logits.detach(), labels, source_ids, self.source_sums.shape[1])
        labels = first_label_slot(labels)  # evaluation rows may carry several label slots
        loss, mtp_sums = token_and_mtp_loss(self.loss_fn, logits, mtp_logits, labels, self.mtp_weight)
        if mtp_sums is not None and counted and self.mtp_sums is not None:
            self.mtp_sums += mtp_sums
        return loss / self.divisor


def build_schedule(plan: PipelinePlan, stages: list[PipelineStage], loss_fn: Callable) -> _PipelineSchedule:
    cls = get_schedule_class(plan.schedule)
    # scale_grads=False: loss_fn is already normalised by the step's token count (see the module docstring).
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=plan.n_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclasses.dataclass
class Pipeline:
    """This rank's pipeline stages and the schedule that runs them."""

    plan: PipelinePlan
    schedule: _PipelineSchedule
    parts: list[nn.Module]
    """The stage modules this rank holds, in stage order."""
    loss: _DivisorLoss
    group: dist.ProcessGroup
    """The pp process group."""

    mtp_depth: int = 0
    """Multi-token prediction depths of the model (protocols.model.mtp_settings)."""

    def step(
        self,
        inputs,
        labels: torch.Tensor,
        divisor: torch.Tensor,
        source_ids: torch.Tensor | None = None,
        num_sources: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Forward and backward of one local batch; returns (the batch's token-loss sum over `divisor`, the
        step's global token count; with `source_ids`, the batch's [2, num_sources] per-source token-loss
        sums and token counts, else None; for a model with multi-token prediction its [2, D] per-depth loss
        sums and token counts, else None), all on every pp rank. Every pp rank passes the same batch: the
        first stage reads the inputs, the last the labels and source ids."""
        if self.mtp_depth:
            self.loss.mtp_sums = torch.zeros(2, self.mtp_depth, device=labels.device)
        try:
            loss, sums = self._run(self.schedule.step, inputs, labels, divisor, source_ids, num_sources,
                                   return_outputs=False)
            mtp_sums = self.loss.mtp_sums
        finally:
            self.loss.mtp_sums = None
        if mtp_sums is not None:  # held by the last stage; zeros elsewhere
            dist.all_reduce(mtp_sums, group=self.group)
        return loss, sums, mtp_sums

    def eval(
        self, inputs, labels: torch.Tensor, source_ids: torch.Tensor | None = None, num_sources: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward only; returns (the summed token loss of the batch, per-source sums as in `step` or None)
        on every pp rank."""
        with _forward_only(self.schedule):
            return self._run(self.schedule.eval, inputs, labels, 1.0, source_ids, num_sources)

    def _run(self, run, inputs, labels, divisor, source_ids, num_sources, **kw):
        tokens, extra = split_inputs(inputs)
        losses: list[torch.Tensor] = []
        target = labels
        if source_ids is not None:
            target = torch.stack((labels, source_ids.to(labels.dtype)), dim=-1)
            self.loss.source_sums = torch.zeros(2, num_sources, device=labels.device)
        self.loss.divisor = divisor
        try:
            run(tokens, target=target, losses=losses, **kw, **extra)
            source_sums = self.loss.source_sums
        finally:
            self.loss.divisor, self.loss.source_sums = 1.0, None
        if source_sums is not None:  # held by the last stage; zeros elsewhere
            dist.all_reduce(source_sums, group=self.group)
        return self._on_every_stage(losses, labels.device), source_sums

    def _on_every_stage(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Sum of the last stage's microbatch losses, on every pp rank (the others contribute zero)."""
        total = torch.zeros((), device=device)
        for loss in losses:
            total += loss_value(loss)
        dist.all_reduce(total, group=self.group)
        return total


def check_pipeline(plan: PipelinePlan, parallel_dims, job_config) -> None:
    """What a pipeline plan must satisfy beyond its own shape (called by the job planner)."""
    e = job_config.eval
    if e.enable and e.local_batch_size % plan.n_microbatches:
        raise LayoutError(
            f"--eval.local_batch_size {e.local_batch_size} must be a multiple of the {plan.n_microbatches} "
            f"pipeline microbatches (evaluation runs through the same schedule)"
        )
    v = job_config.validation
    if v.enable and v.local_batch_size % plan.n_microbatches:
        raise LayoutError(
            f"--validation.local_batch_size {v.local_batch_size} must be a multiple of the {plan.n_microbatches} "
            f"pipeline microbatches (validation runs through the same schedule)"
        )
    ac = job_config.activation_checkpoint
    if plan.schedule in SPLIT_BACKWARD and ac.mode == "selective" and ac.selective_ac_option == "op":
        # Measured (torch 2.13): "Trying to backward an extra time. You are only allowed to backward once on
        # any region computed under selective activation checkpoint", mid-step.
        raise LayoutError(
            f"{plan.schedule} cannot run with selective op activation checkpointing (its weight-gradient pass is "
            f"a second backward over regions that op-selective AC lets run backward once); use "
            f"--activation_checkpoint.mode full or none, selective_ac_option k (every k-th block), or a schedule "
            f"without split backward (1F1B, Interleaved1F1B)"
        )
    if (
        plan.schedule in SPLIT_BACKWARD
        and parallel_dims.fsdp_enabled
        and job_config.parallelism.fsdp_reshard_after_forward == "always"
    ):
        # The weight pass differentiates the parameter objects the input pass saw; FSDP resharding in
        # between swaps them out and those gradients are silently lost.
        raise LayoutError(
            f"{plan.schedule} cannot run with --parallelism.fsdp_reshard_after_forward always (its weight-gradient "
            f"pass needs the stage's parameters still gathered); use default or never"
        )


def split_backward_recompute(schedule: str, ac) -> str | None:
    """A split-backward schedule with AC that recomputes whole blocks (full, or every k-th block): its weight
    pass recomputes each checkpointed block once per weight, because torch's stage_backward_weight runs one
    autograd call per parameter group and the non-reentrant checkpoint recomputes once per call (counted in
    tests/unit/test_dry_run.py). It runs, slowly: the line the trainer logs at start and the dry run prints;
    None for every other pair."""
    whole_blocks = ac.mode == "full" or (ac.mode == "selective" and ac.selective_ac_option.isdigit())
    if schedule not in SPLIT_BACKWARD or not whole_blocks:
        return None
    mode = "full" if ac.mode == "full" else f"selective {ac.selective_ac_option}"
    return (f"{schedule} with {mode} AC: its weight pass recomputes each checkpointed block once per weight (a "
            f"Llama block: 9 more forwards per microbatch, beside the input pass's one), priced by no estimate; "
            f"use 1F1B or Interleaved1F1B with full AC, or {schedule} without AC")


def plan_model_pipeline(model: nn.Module, parallel_dims, job_config) -> PipelinePlan:
    """The checked pipeline plan of a (meta) model that follows the model protocol."""
    order = module_order(model, model.pipeline_head, model.pipeline_tail)
    costs = None
    if job_config.parallelism.pipeline_parallel_split == "balanced":
        # Attention score/value FLOPs have no weights: from the model's args where it keeps them.
        args = getattr(model, "model_args", None)
        seq_len = job_config.training.seq_len
        attention = args.flops_per_token(0, seq_len) / len(model.layers) if args is not None else 0.0
        costs = module_flops(model, order, attention)
    plan = plan_pipeline(
        job_config.parallelism,
        order,
        len(model.pipeline_head),
        len(model.pipeline_tail),
        job_config.training.local_batch_size,
        costs,
    )
    check_pipeline(plan, parallel_dims, job_config)
    return plan


def pipeline_model(
    model: nn.Module,
    parallel_dims,
    job_config,
    device: torch.device,
    parallelize_fn: Callable,
    loss_fn: Callable,
) -> Pipeline:
    """Splits a meta model into this rank's stages, parallelises each with `parallelize_fn` (the same
    function a whole model gets), and builds the schedule. `loss_fn` returns the summed token loss."""
    plan = plan_model_pipeline(model, parallel_dims, job_config)
    head, tail = model.pipeline_head, model.pipeline_tail
    pp_mesh = parallel_dims.submesh("pp")
    pp_rank = pp_mesh.get_local_rank()
    parts, stages = [], []
    for s in plan.local_stages(pp_rank):
        part = parallelize_fn(split_stage(model, plan.stages[s], head, tail), parallel_dims, job_config)
        parts.append(part)
        # No example inputs: the stages infer activation shapes from the first microbatch (and again when
        # switching between training and validation), including sequence-sharded hidden states under TP.
        stages.append(_Stage(part, s, plan.num_stages, device, group=pp_mesh.get_group()))
    mtp_depth, mtp_weight = mtp_settings(model)
    loss = _DivisorLoss(loss_fn, mtp_weight)
    return Pipeline(plan, build_schedule(plan, stages, loss), parts, loss, pp_mesh.get_group(), mtp_depth)


_FORWARD_ACTIONS = {
    _ComputationType.FORWARD,
    _ComputationType.SEND_F,
    _ComputationType.RECV_F,
    _ComputationType.UNSHARD,
    _ComputationType.RESHARD,
}


def _forward_actions(actions: list) -> list:
    out = []
    for a in actions:
        parts = a.sub_actions if a.computation_type == _ComputationType.OVERLAP_F_B else (a,)
        out += [p for p in parts if p.computation_type in _FORWARD_ACTIONS]
    return out


@contextlib.contextmanager
def _forward_only(schedule: _PipelineSchedule):
    """torch 2.13's multi-stage schedules execute their backward actions in eval() as well, and V-shaped
    ones then fail handing gradients between their two local stages; evaluation keeps the forward
    actions (and their sends/receives) only."""
    if not isinstance(schedule, _PipelineScheduleRuntime):
        yield
        return
    full = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: _forward_actions(actions) for rank, actions in full.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = full
