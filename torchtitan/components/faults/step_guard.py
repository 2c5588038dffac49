"""The spike and non-finite guard: every step's global loss and gradient norm judged before the optimizer step.

A value is an event when it is not finite, or, once `window` accepted steps are known, when it is above

    max + threshold x scale,   scale = max(1.4826 x MAD, floor x |median|)

over those steps, floor = 10% for the loss, 50% for the gradient norm: the value must clear the highest of the
recent values, not their middle, by a margin measured in a robust spread (MAD: the median absolute deviation;
1.4826 x MAD estimates a standard deviation, and a few spikes in the window do not inflate it as they would a
standard deviation). Why each part:

* The maximum, not the median, is the baseline: a curve that rises steadily (the gradient norm during the LR
  warmup) puts each new value above the window's middle but hardly above its top, while a spike is above the
  top by a multiple. A trend moves the baseline with it.
* The floor on the scale: a smooth curve has a tiny MAD (on a short window it is 0 or one gap), and with a tiny
  scale ordinary step-to-step movement reads as many standard deviations. How much a healthy curve moves in one
  step differs by metric: the loss by percents, the gradient norm by multiples (2.4x in one step of the debug
  recipe's warmup, as the loss leaves its plateau: docs/reliability.md). With the default threshold (6) an
  event is a loss 60% of the median above the window's maximum, or a gradient norm at 4x a flat window's level;
  a poisoned batch (1e4x) or a learning rate far too high (the norm grows tenfold and more) clears that.
* `window` is at least MIN_WINDOW (4): a median and a MAD of fewer values are not a spread (of one value the
  MAD is 0, of two it is half their gap); pre-flight refuses smaller windows with one line.

The action, by --guard.action: `skip` the optimizer update of that step (the LR schedule and the data position
advance as they would), or `rollback` to the last complete checkpoint and skip the offending step's data window
(the trainer does both). Every event is a metrics.jsonl row (guard/...) and one log line naming the step, the
value and the action; past --guard.max_events the run stops with one line. docs/reliability.md has the figures
(scripts/diagnostics/guard_trace.py: clean runs give no event at any window, a 1e4x gradient is caught at every window).

Every rank decides the same: the values are the global loss (summed over data-parallel ranks) and the global
gradient norm, reduced once more with MAX over all ranks (a pipeline stage without the loss holds 0), with
non-finite values turned into +inf first, so each rank judges identical numbers against an identical history.
"""

import math
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Guard as GuardConfig
from torchtitan.components.faults.training_error import TrainingError
from torchtitan.tools.logging import logger

MAD_TO_SIGMA = 1.4826
SCALE_FLOOR = {"loss": 0.1, "grad_norm": 0.5}  # the scale's floor, a fraction of |median| (module docstring)
MIN_WINDOW = 4
METRICS = ("loss", "grad_norm")


@dataclass
class GuardEvent:
    step: int
    metric: str  # "loss" or "grad_norm"
    value: float
    limit: float  # nan for a non-finite value
    action: str  # "skip" or "rollback"

    def describe(self) -> str:
        why = "is not finite" if math.isnan(self.limit) else f"is above the spike limit {self.limit:.6g}"
        return f"step {self.step}: {self.metric} {self.value:.6g} {why}"


def check_guard_config(cfg: GuardConfig, checkpoint_enabled: bool) -> None:
    """One line for settings the guard cannot work with (called by the pre-flight check)."""
    if cfg.window < MIN_WINDOW:
        raise ValueError(f"--guard.window {cfg.window} is too small to judge a spike: the spread (MAD) of fewer than "
                         f"{MIN_WINDOW} steps is not a spread; use --guard.window {MIN_WINDOW} or more (default 20)")
    if not (math.isfinite(cfg.threshold) and cfg.threshold > 0):
        raise ValueError(f"--guard.threshold must be a positive number (robust standard deviations), got {cfg.threshold}")
    if cfg.replica_check_interval < 0:
        raise ValueError(f"--guard.replica_check_interval must be 0 (off) or more, got {cfg.replica_check_interval}")
    if cfg.max_events < 0:
        raise ValueError(f"--guard.max_events must be 0 (stop at the first event) or more, got {cfg.max_events}")
    if cfg.enable and cfg.action == "rollback" and not checkpoint_enabled:
        raise ValueError("--guard.action rollback reloads the last checkpoint: add --checkpoint.enable, or use "
                         "--guard.action skip")


class StepGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history = {m: deque(maxlen=cfg.window) for m in METRICS}
        self.events = 0

    def judge(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> GuardEvent | None:
        """`loss` summed over the data-parallel ranks already; returns the event, or None (then the values join
        the history)."""
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(loss.device)])
        values = torch.where(torch.isfinite(values), values, torch.full_like(values, math.inf))
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        judged = dict(zip(METRICS, values.tolist()))
        for metric, value in judged.items():
            limit = self._limit(metric)
            if not math.isfinite(value):
                return GuardEvent(step, metric, value, math.nan, self.cfg.action)
            if limit is not None and value > limit:
                return GuardEvent(step, metric, value, limit, self.cfg.action)
        for metric, value in judged.items():
            self.history[metric].append(value)
        return None

    def _limit(self, metric: str) -> float | None:
        h = self.history[metric]
        if len(h) < self.cfg.window:
            return None
        median = statistics.median(h)
        mad = statistics.median(abs(x - median) for x in h)
        return max(h) + self.cfg.threshold * max(MAD_TO_SIGMA * mad, SCALE_FLOOR[metric] * abs(median))

    def record(self, event: GuardEvent, metrics) -> None:
        """The event's metrics.jsonl row and log line; raises TrainingError once past max_events."""
        self.events += 1
        metrics.log(event.step, {"guard/event": self.events, f"guard/{event.metric}": event.value,
                                 "guard/limit": event.limit, f"guard/{event.action}": 1}, console=False)
        stop = self.events > self.cfg.max_events
        logger.warning(f"Guard: {event.describe()}; action: {'stop' if stop else event.action} "
                       f"(event {self.events}, --guard.max_events {self.cfg.max_events})")
        if stop:
            raise TrainingError(
                f"the guard stopped the run at {event.describe()}, event {self.events} of at most "
                f"{self.cfg.max_events} (--guard.max_events); resume from the last checkpoint with a lower "
                f"--optimizer.lr or --training.max_norm, check the data near this step, or raise --guard.max_events"
            )
