"""The spike and non-finite guard: every step's global loss and gradient norm judged before the optimizer step.

A value is an event when it is not finite, or, once `window` accepted steps are known, when, judged on the log
scale against the window's values w:

    loss       > max(w) x max(LOSS_RATIO, exp(threshold x 1.4826 x MAD(ln w)))     LOSS_RATIO = 1.6
    grad norm  > median(w) x GRAD_NORM_RATIO                                      GRAD_NORM_RATIO = 100

(MAD: the median absolute deviation; 1.4826 x MAD estimates a standard deviation, and a few spikes in the window
do not inflate it as they would a standard deviation). Why each part (measured on the shipped recipes, every
window from 4 to 20: docs/reliability.md):

* The log scale: healthy curves move by ratios (the gradient norm 2.4x in one step of the debug recipe's warmup,
  a loss by percents whether it is 8 or 0.8), so the margins are ratios.
* The loss against the window's top: the loss trends (the warmup, a schedule or batch change), and a value
  above the window's middle but hardly above its top is a trend moving the baseline with it; the loss has no
  isolated spikes that would lift the top. Its healthy one-step rise over the top is at most 1.26x (1.72x over
  the median); a learning rate far too high sends it 50x up (7.8 -> 400). The margin widens to `threshold`
  robust standard deviations where the window is noisier than that (small batches of mixed data).
* The gradient norm against the window's median, by a fixed 100x: a healthy gradient norm has isolated
  one-step spikes of tens (the MoE debug recipe: 54.6 against about 1.3, 42x its window's median; clipping at
  --training.max_norm bounds the update they make and the loss does not move), and one such spike in the window
  lifts a maximum baseline for `window` steps (a 1e4x gradient right after it is only 193x the window's top; in
  the unstable LoRA run, right after its 582 spike, 12x: missed). 100x sits 2.4x above the largest healthy spike measured and 20x under the smallest injected 1e4x
  gradient (a poisoned batch); a trend would have to grow the norm 100-fold within half a window. No spread
  term: the gradient norm's spread is its trends and its clipped spikes, and widening the margin by it hides
  faults (qwen3_debug's norm falls 28.8 -> 2.3 in its first 7 steps; a margin of 6 robust standard deviations
  of that window is 3,000x and misses a 1e4x gradient at step 9). A gradient spike under 100x that hurts the
  loss is caught by the loss.
* `window` is at least MIN_WINDOW (4): a median and a MAD of fewer values are not a spread (of one value the
  MAD is 0, of two it is half their gap); pre-flight refuses smaller windows with one line.

The action, by --guard.action: `skip` the optimizer update of that step (the LR schedule and the data position
advance as they would), or `rollback` to the last complete checkpoint and skip the offending step's data window
(the trainer does both). Every event is a metrics.jsonl row (guard/...) and one log line naming the step, the
value and the action; more than --guard.max_events events within --guard.event_span steps (an event at step s
counts until step s + event_span) stop the run with one line. docs/reliability.md has the figures
(scripts/diagnostics/guard_trace.py: clean runs give no event at any window, a 1e4x gradient is caught at every window).

Every rank decides the same: the values are the global loss (summed over data-parallel ranks) and the global
gradient norm, reduced once more with MAX over all ranks (a pipeline stage without the loss holds 0), with
non-finite values turned into +inf first, so each rank judges identical numbers against an identical history.
"""

import math
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchtitan.config.job_config import Guard as GuardConfig
from torchtitan.components.faults.training_error import TrainingError
from torchtitan.tools.logging import logger

MAD_TO_SIGMA = 1.4826
LOSS_RATIO = 1.6  # the least margin of a loss spike over the window's maximum (module docstring)
GRAD_NORM_RATIO = 100.0  # the margin of a gradient-norm spike over the window's median (module docstring)
MIN_WINDOW = 4
METRICS = ("loss", "grad_norm")
_TINY = 1e-30  # a value of 0 (a pipeline stage without the loss reports 0) is taken as this on the log scale


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
    if cfg.event_span < 0:
        raise ValueError(f"--guard.event_span must be 0 (count the events of the whole run) or more steps, got "
                         f"{cfg.event_span}")
    if cfg.enable and cfg.action == "rollback" and not checkpoint_enabled:
        raise ValueError("--guard.action rollback reloads the last checkpoint: add --checkpoint.enable, or use "
                         "--guard.action skip")


def spike_limit(window: Sequence[float], metric: str, threshold: float) -> float:
    """The value above which `metric` is a spike after the accepted values `window` (the module docstring)."""
    logs = [math.log(max(v, _TINY)) for v in window]
    median = statistics.median(logs)
    if metric == "grad_norm":
        return math.exp(median) * GRAD_NORM_RATIO
    mad = statistics.median(abs(x - median) for x in logs)
    return math.exp(max(logs) + max(threshold * MAD_TO_SIGMA * mad, math.log(LOSS_RATIO)))


def decide(history: Mapping[str, Sequence[float]], values: Mapping[str, float], window: int,
           threshold: float) -> tuple[str, float] | None:
    """The guard's judgement, a pure function: (metric, limit) of the first value in `values` (by METRICS) that
    is an event after `history` (each metric's accepted values, the last `window` of them judged; limit nan for a
    non-finite value), or None."""
    for metric in METRICS:
        value = values[metric]
        if not math.isfinite(value):
            return metric, math.nan
        h = history[metric]
        if len(h) >= window:
            limit = spike_limit(list(h)[-window:], metric, threshold)
            if value > limit:
                return metric, limit
    return None


def replay(series: Iterable[tuple[int, float, float]], cfg: GuardConfig) -> list[GuardEvent]:
    """The events the guard finds over a logged run [(step, loss, grad_norm)]. While no event happened the history
    is exactly these values, so the first event is the one the trainer would act on; after it, each event's
    values stay out of the history, as in the trainer with --guard.action skip."""
    history, events = {m: deque(maxlen=cfg.window) for m in METRICS}, []
    for step, loss, norm in series:
        values = {"loss": loss, "grad_norm": norm}
        judged = decide(history, values, cfg.window, cfg.threshold)
        if judged is not None:
            events.append(GuardEvent(step, judged[0], values[judged[0]], judged[1], cfg.action))
            continue
        for metric in METRICS:
            history[metric].append(values[metric])
    return events


def missed_spikes(series: Iterable[tuple[int, float, float]], cfg: GuardConfig, scale: float = 1e4) -> list[int]:
    """The steps of a logged run at which its gradient norm times `scale` (a poisoned batch) would not be an
    event, among those the guard judges (the window full). Each step is probed against the history the clean
    run had there (its own events kept out, as `replay` does), so one pass covers an injection at every step."""
    history, missed = {m: deque(maxlen=cfg.window) for m in METRICS}, []
    for step, loss, norm in series:
        if len(history["grad_norm"]) >= cfg.window and decide(
                history, {"loss": loss, "grad_norm": norm * scale}, cfg.window, cfg.threshold) is None:
            missed.append(step)
        if decide(history, {"loss": loss, "grad_norm": norm}, cfg.window, cfg.threshold) is None:
            for metric, value in (("loss", loss), ("grad_norm", norm)):
                history[metric].append(value)
    return missed


class StepGuard:
    def __init__(self, cfg: GuardConfig):
        self.cfg = cfg
        self.history = {m: deque(maxlen=cfg.window) for m in METRICS}
        self.events = 0  # over the run: the metrics row's guard/event
        self.recent: deque[int] = deque()  # the steps of the events --guard.max_events counts

    def judge(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> GuardEvent | None:
        """`loss` summed over the data-parallel ranks already; returns the event, or None (then the values join
        the history)."""
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(loss.device)])
        values = torch.where(torch.isfinite(values), values, torch.full_like(values, math.inf))
        if dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
        judged = dict(zip(METRICS, values.tolist()))
        decision = decide(self.history, judged, self.cfg.window, self.cfg.threshold)
        if decision is not None:
            metric, limit = decision
            return GuardEvent(step, metric, judged[metric], limit, self.cfg.action)
        for metric, value in judged.items():
            self.history[metric].append(value)
        return None

    def record(self, event: GuardEvent, metrics) -> None:
        """The event's metrics.jsonl row and log line; raises TrainingError once more than max_events events fall
        within event_span steps."""
        self.events += 1
        self.recent.append(event.step)
        span = self.cfg.event_span
        while span and self.recent and self.recent[0] <= event.step - span:  # a rollback repeats steps: by number
            self.recent.popleft()
        metrics.log(event.step, {"guard/event": self.events, f"guard/{event.metric}": event.value,
                                 "guard/limit": event.limit, f"guard/{event.action}": 1}, console=False)
        counted = len(self.recent)
        within = f"in the last {span} steps" if span else "in this run"
        stop = counted > self.cfg.max_events
        logger.warning(f"Guard: {event.describe()}; action: {'stop' if stop else event.action} "
                       f"(event {counted} {within}, --guard.max_events {self.cfg.max_events})")
        if stop:
            raise TrainingError(
                f"the guard stopped the run at {event.describe()}, event {counted} {within} where at most "
                f"{self.cfg.max_events} are allowed (--guard.max_events, --guard.event_span); resume from the last "
                f"checkpoint with a lower --optimizer.lr or --training.max_norm, check the data near this step, or "
                f"raise --guard.max_events"
            )
