"""torch's own pipeline schedules, played without devices: which (stage, microbatch) passes each pp rank runs
in which order, and what that order costs in time.

torch's multi-stage schedule classes (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble,
DualPipeV) compute every rank's action list (`pipeline_order`) when they are built. They are built here on
placeholder stages (no model, no process group), so the memory estimator and the planner read the very
order the trainer will run instead of a formula for it.
"""

import functools

from torch.distributed.pipelining.schedules import _Action, _ComputationType, get_schedule_class
from torch.distributed.pipelining.stage import _PipelineStageBase

F, B, I, W = (_ComputationType.FORWARD, _ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_INPUT,
              _ComputationType.BACKWARD_WEIGHT)
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


class _Placeholder(_PipelineStageBase):
    """What a schedule class reads from its stages while computing its order."""

    def _create_grad_recv_info(self, *args, **kwargs): ...

    def _prepare_backward_infra(self, *args, **kwargs): ...

    def _prepare_forward_infra(self, *args, **kwargs): ...


@functools.lru_cache(maxsize=None)
def schedule_order(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int) -> dict[int, list[_Action]]:
    """Each pp rank's actions in the order torch's `schedule` runs them (bubbles dropped; DualPipeV's
    overlapped forward-backward pairs are one action with `sub_actions`)."""
    n = pp * stages_per_rank
    stages = []
    for i in ([0, n - 1] if schedule in V_SHAPED else range(0, n, pp)):  # rank 0's stages
        stage = object.__new__(_Placeholder)
        stage.__dict__.update(stage_index=i, num_stages=n, group_size=pp, group_rank=0, is_first=i == 0,
                              is_last=i == n - 1, submod=None)
        stages.append(stage)
    cls = get_schedule_class(schedule)
    # The order without the send/recv actions torch adds for running it (slow to add, not needed here).
    lean = type(cls.__name__, (cls,), {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None})
    built = lean(stages, n_microbatches=n_microbatches, loss_fn=lambda *a: 0, scale_grads=False)
    return {rank: [a for a in actions if a is not None] for rank, actions in built.pipeline_order.items()}


def passes(action: _Action) -> tuple[_Action, ...]:
    return action.sub_actions or (action,)


@functools.lru_cache(maxsize=None)
def splits_backward(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int) -> bool:
    """Whether the played order has separate input- and weight-gradient passes (from torch's order itself,
    rather than a list of schedule names)."""
    return any(p.computation_type in (I, W) for a in schedule_order(schedule, n_microbatches, pp, stages_per_rank)[0]
               for p in passes(a))


@functools.lru_cache(maxsize=None)
def bubble_fraction(schedule: str, n_microbatches: int, pp: int, stages_per_rank: int,
                    forward: float, input_grad: float, weight_grad: float) -> float:
    """The schedule's step time over its busiest rank's compute, minus 1, with stages of equal cost: a
    stage's forward of one microbatch takes `forward`, its input-gradient pass `input_grad`, its
    weight-gradient pass `weight_grad` (a full backward both). Each rank runs its actions in torch's order,
    one at a time, each as soon as what it needs is done: a forward waits for the previous stage's forward
    of that microbatch, a backward (or input pass) for the next stage's one. Communication takes no time
    here (the planner charges it separately)."""
    order = schedule_order(schedule, n_microbatches, pp, stages_per_rank)
    cost = {F: forward, B: input_grad + weight_grad, I: input_grad, W: weight_grad}
    last = pp * stages_per_rank - 1
    done: dict[tuple, float] = {}  # (pass kind, stage, microbatch) -> finish time; B and I both count as "back"
    clock = [0.0] * pp
    position = [0] * pp
    busy = [sum(cost[p.computation_type] for a in order[r] for p in passes(a)) for r in range(pp)]

    def ready(p: _Action) -> float | None:
        s, k, kind = p.stage_index, p.microbatch_index, p.computation_type
        if kind == F:
            return done.get(("F", s - 1, k)) if s > 0 else 0.0
        if kind in (B, I):
            return done.get(("back", s + 1, k)) if s < last else done.get(("F", s, k))
        return done.get(("back", s, k))  # W after this stage's input pass

    while any(position[r] < len(order[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while position[r] < len(order[r]):
                subs = passes(order[r][position[r]])
                starts = [ready(p) for p in subs]
                if any(t is None for t in starts):
                    break
                finish = max([clock[r], *starts]) + sum(cost[p.computation_type] for p in subs)
                for p in subs:
                    key = "F" if p.computation_type == F else "W" if p.computation_type == W else "back"
                    done[(key, p.stage_index, p.microbatch_index)] = finish
                clock[r], position[r], progressed = finish, position[r] + 1, True
        if not progressed:
            raise RuntimeError(f"{schedule}: the played order deadlocks (pp {pp}, {n_microbatches} microbatches)")
    return max(clock) / max(busy) - 1
