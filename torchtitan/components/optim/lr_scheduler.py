"""Learning-rate schedule: linear warmup, then warmup-stable-decay (WSD).

Step indexing, precisely. `lr_factor(step)` is the multiplier of the peak LR after `step` optimizer steps have
been taken. torch's LambdaLR applies `lr_factor(0)` when it is built, and the trainer calls `scheduler.step()`
after each optimizer step, so the trainer's step `s` (counted from 1 in the logs) trains with `lr_factor(s - 1)`.

With W = warmup_steps, T = total_steps, D = decay steps (see `decay_steps`) and S = T - W - D stable steps:

* warmup, step in [0, W):        (step + 1) / W        trainer steps 1..W go 1/W, 2/W, ..., 1.0
* stable, step in [W, W + S):    1.0
* decay,  step in [W + S, T):    min + (1 - min) * shape(p),  p = (step - W - S) / D  in [0, (D - 1) / D]
* after,  step >= T:             min_lr_factor

The first decay step still trains at 1.0 and the factor reaches `min_lr_factor` at step T, i.e. right after the
last optimizer step; so no trainer step is wasted on a zero LR when min_lr_factor is 0 (the default).
shape(p) is 1 - p (linear), 1 - sqrt(p) (sqrt) or (1 + cos(pi p)) / 2 (cosine).

Extending a run (resuming with another training.steps) re-fits the schedule: the table is rebuilt for the new
T, the restored step count indexes it, and the LR of the next step is the new table's at that step. Steps
already taken are not replayed, so a run extended after its decay jumps back to the new schedule's LR at that
point (with the default decay_ratio=None, e.g. 10 steps extended to 20 resumes at about half the peak). A
schedule whose shape does not depend on T (warmup then constant: decay_ratio=0) extends seamlessly.
"""

import functools
import math
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from torchtitan.components.optim.optimizer import OptimizersContainer
from torchtitan.config.job_config import LRScheduler as LRSchedulerConfig
from torchtitan.tools.logging import logger

_DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "sqrt": lambda p: 1.0 - math.sqrt(p),
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
}


def decay_steps(*, warmup_steps: int, total_steps: int, decay_ratio: float | None) -> int:
    """Steps of the decay phase: round(decay_ratio x total_steps), or all steps after warmup when None.

    Clamped (like torchtitan) to the steps left after warmup, so warmup + decay never exceed total_steps: a
    decay_ratio of 1.0 then means "decay right after warmup". `build_lr_schedulers` warns when this clamps.
    """
    steps_after_warmup = max(total_steps - warmup_steps, 0)
    if decay_ratio is None:
        return steps_after_warmup
    return min(round(decay_ratio * total_steps), steps_after_warmup)


def lr_factor(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_ratio: float | None,
    decay_type: str,
    min_lr_factor: float,
) -> float:
    """Multiplier of the peak LR after `step` optimizer steps (see the module docstring for the exact table)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    num_decay = decay_steps(warmup_steps=warmup_steps, total_steps=total_steps, decay_ratio=decay_ratio)
    decay_start = total_steps - num_decay
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / num_decay, 1.0) if num_decay > 0 else 1.0
    return min_lr_factor + (1.0 - min_lr_factor) * _DECAY_SHAPES[decay_type](progress)


class LRSchedulersContainer:
    """One LambdaLR per optimizer of an OptimizersContainer, stepped together.

    All schedulers follow the same schedule, so the state dict is that of the first one and loads into every
    one: a checkpoint then resumes under a pipeline split with a different number of model parts.
    """

    def __init__(self, schedulers: list[LambdaLR], total_steps: int) -> None:
        self.schedulers = schedulers
        self.total_steps = total_steps

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The current LR of every param group, over all optimizers."""
        return [lr for scheduler in self.schedulers for lr in scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_lr = state_dict["_last_lr"][0]  # the LR the saved schedule gives the next step
        for scheduler in self.schedulers:
            # LambdaLR.load_state_dict pops "lr_lambdas" from the dict it gets, hence one copy per scheduler.
            scheduler.load_state_dict(dict(state_dict))
            # The restored step count indexes this run's schedule (re-fit when training.steps changed), and the
            # optimizer's LR is set now: LambdaLR leaves it at the value it was built with until the next step().
            lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            scheduler._last_lr = lrs
            for group, lr in zip(scheduler.optimizer.param_groups, lrs):
                group["lr"] = lr
        lr = self.get_last_lr()[0]
        if lr != saved_lr:
            logger.warning(
                f"LR schedule re-fit to this run's settings ({self.total_steps} steps): step "
                f"{self.schedulers[0].last_epoch + 1} trains at LR {lr:.4g}, the saved schedule's next LR was {saved_lr:.4g}"
            )


def check_schedule(cfg: LRSchedulerConfig, total_steps: int) -> None:
    """Raises ValueError with one line for a schedule that cannot run (also the pre-flight check's rule)."""
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, got {total_steps}")
    if cfg.warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {cfg.warmup_steps}")
    if cfg.decay_ratio is not None and not 0.0 <= cfg.decay_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.decay_ratio must be in [0, 1] or None, got {cfg.decay_ratio}")
    if cfg.decay_type not in _DECAY_SHAPES:
        raise ValueError(f"lr_scheduler.decay_type must be one of {sorted(_DECAY_SHAPES)}, got {cfg.decay_type!r}")
    if not 0.0 <= cfg.min_lr_factor <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {cfg.min_lr_factor}")


def build_lr_schedulers(
    optimizers: OptimizersContainer, cfg: LRSchedulerConfig, total_steps: int
) -> LRSchedulersContainer:
    check_schedule(cfg, total_steps)
    if cfg.warmup_steps > total_steps:
        logger.warning(
            f"lr_scheduler.warmup_steps ({cfg.warmup_steps}) exceeds training.steps ({total_steps}): "
            "the run ends before reaching the peak learning rate"
        )
    elif cfg.decay_ratio is not None:
        requested = round(cfg.decay_ratio * total_steps)
        clamped = decay_steps(warmup_steps=cfg.warmup_steps, total_steps=total_steps, decay_ratio=cfg.decay_ratio)
        if clamped < requested:
            logger.warning(
                f"warmup ({cfg.warmup_steps}) + decay ({requested} = decay_ratio {cfg.decay_ratio} x {total_steps}) "
                f"steps exceed training.steps ({total_steps}); decaying over the last {clamped} steps instead"
            )
    factor = functools.partial(
        lr_factor,
        warmup_steps=cfg.warmup_steps,
        total_steps=total_steps,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return LRSchedulersContainer([LambdaLR(optimizer, factor) for optimizer in optimizers.optimizers], total_steps)
