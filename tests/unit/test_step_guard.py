"""The spike guard's judgement (window max + threshold x robust scale; non-finite always), clean warmups that
raise no event at any window, and real spikes caught at every window: a 1e4x gradient, and a learning rate
raised mid-run, which, past --guard.max_events, stops the run with one line. The FSDP 2 parity tests of its actions are in
tests/distributed/test_step_guard.py."""

import functools
import json
import math
import os
import statistics

import pytest
import torch

from tests.unit.checkpoint_helpers import run
from torchtitan.components.faults.step_guard import MIN_WINDOW, StepGuard
from torchtitan.config.job_config import Guard


class Rows:
    def __init__(self):
        self.rows = []

    def log(self, step, values, console=True):
        self.rows.append((step, values))


def judge(guard, step, loss, norm):
    return guard.judge(step, torch.tensor(loss), torch.tensor(norm))


def test_the_limit_clears_the_window_maximum():
    guard = StepGuard(Guard(enable=True, window=4, threshold=6.0))
    for step, loss in enumerate([5.0, 5.2, 4.8, 5.1], 1):  # the window fills; nothing is judged a spike yet
        assert judge(guard, step, loss, 1.0) is None
    # max 5.2, median 5.05, MAD 0.1: 1.4826 x MAD = 0.148 is under the floor 10% x 5.05 -> limit 5.2 + 6 x 0.505
    limit = 5.2 + 6 * 0.505
    assert judge(guard, 5, 8.2, 1.0) is None
    # the window is now 5.2, 4.8, 5.1, 8.2: max 8.2, median 5.15, MAD 0.2 -> limit 8.2 + 6 x 0.515
    event = judge(guard, 6, 11.3, 1.0)
    assert (event.step, event.metric, event.action) == (6, "loss", "skip")
    assert math.isclose(event.limit, 8.2 + 6 * 0.515, rel_tol=1e-6)  # the values are judged as float32
    assert limit < 8.2 + 6 * 0.515
    assert list(guard.history["loss"]) == pytest.approx([5.2, 4.8, 5.1, 8.2], rel=1e-6)  # an event does not join the history
    assert judge(guard, 6, 11.2, 1.0) is None
    # The gradient norm of a flat curve (MAD 0): the floor (50% of the median) sets the scale -> limit 4.
    assert judge(guard, 7, 11.2, 4.01).metric == "grad_norm"
    assert judge(guard, 7, 11.2, 3.99) is None
    nan = judge(guard, 8, 5.0, float("nan"))
    assert nan.metric == "grad_norm" and math.isinf(nan.value) and math.isnan(nan.limit)
    rows = Rows()
    guard.record(nan, rows)
    assert rows.rows == [(8, {"guard/event": 1, "guard/grad_norm": math.inf, "guard/limit": nan.limit,
                              "guard/skip": 1})]


def _series(folder) -> list[tuple[int, float, float]]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert not [r for r in rows if "guard/event" in r]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def _events(series, window, spike_at=None, rule=None):
    """The guard's events over a logged run (its history is exactly these values while no event happened, so
    the first event is the one the trainer would act on); the gradient norm at `spike_at` scaled by 1e4 (what
    the guard sees of a poisoned batch: clipping reports the norm before it clips)."""
    guard = StepGuard(Guard(enable=True, window=window))
    if rule is not None:
        guard._limit = functools.partial(rule, guard)
    out = []
    for step, loss, norm in series:
        event = judge(guard, step, loss, norm * 1e4 if step == spike_at else norm)
        if event is not None:
            out.append(event.step)
    return out


def _former_limit(guard, metric):
    """The rule before issue 31 (median + 6 x max(1.4826 MAD, 1% of the median)): the negative control."""
    h = guard.history[metric]
    if len(h) < guard.cfg.window:
        return None
    m = statistics.median(h)
    return m + guard.cfg.threshold * max(1.4826 * statistics.median(abs(x - m) for x in h), 0.01 * m)


@pytest.fixture(scope="module")
def debug_recipe_run(tmp_path_factory):
    """The issue's run on one process: the debug recipe (LR warmup over 10 steps), seq 128, fp32, seed 7,
    global batch 16, with the guard on at its smallest window; 24 steps."""
    from torchtitan.train import main

    folder = tmp_path_factory.mktemp("debug_recipe")
    rc = main(["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "128",
               "--training.mixed_precision_param", "float32", "--debug.seed", "7", "--training.global_batch_size",
               "16", "--training.steps", "24", "--metrics.log_freq", "1", "--validation.enable", "false",
               "--guard.enable", "--guard.window", str(MIN_WINDOW), "--guard.max_events", "0",
               "--job.dump_folder", str(folder)])
    return rc, _series(folder)


def test_the_debug_recipe_warmup_gives_no_event_at_any_window(debug_recipe_run):
    rc, series = debug_recipe_run
    assert rc == 0 and [s for s, _, _ in series] == list(range(1, 25))  # the guard at window 4 let it train
    norms = [n for _, _, n in series]
    assert max(b / a for a, b in zip(norms, norms[1:])) > 2  # the warmup moves the norm by multiples
    for window in range(MIN_WINDOW, Guard.window + 1):
        assert _events(series, window) == [], window
    # The former rule (median baseline, 1% floor) stops this clean run: the test can fail.
    assert _events(series, MIN_WINDOW, rule=_former_limit)


def test_a_poisoned_gradient_is_caught_at_every_window(debug_recipe_run):
    _, series = debug_recipe_run
    for window in range(MIN_WINDOW, Guard.window + 1):
        for spike_at in sorted({window + 1, 24}):
            assert _events(series, window, spike_at) == [spike_at], (window, spike_at)


def test_an_lr_raised_mid_run_is_caught_at_every_window(tmp_path, monkeypatch):
    """From step 25 the LR is 1e4x (fault `scale_lr`; 100x and 1000x did not upset this tiny, barely trained model): the replay of
    that run (guard off) finds the first event at or after step 25 at every window, none before."""
    monkeypatch.setenv("TORCHTITAN_FAULTS", json.dumps([{"kind": "scale_lr", "step": 25, "scale": 1e4}]))
    assert run(tmp_path, "--training.steps", "30", "--debug.seed", "7", "--optimizer.lr", "3e-3") == 0
    series = _series(tmp_path)
    for window in range(MIN_WINDOW, Guard.window + 1):
        events = _events(series, window)
        assert events and 25 <= events[0] <= 30, (window, events)


def test_a_real_spike_is_caught_and_the_limit_stops_the_run(tmp_path, capsys, monkeypatch):
    """The LR raised 1e4x from step 25 (the replay above finds the first event there at every window), with
    the trainer's guard at the default window and no event allowed: the run stops with one line.

    (The former test, an LR warming up to 0.3 within 12 steps judged at window 4, is no longer caught: in
    those first steps its gradient norm rises 2.3x above the window's top, the clean debug recipe's warmup
    2.4x; a rule that tells them apart at window 4 by these statistics does not exist. See reliability.md.)"""
    monkeypatch.setenv("TORCHTITAN_FAULTS", json.dumps([{"kind": "scale_lr", "step": 25, "scale": 1e4}]))
    assert run(tmp_path, "--training.steps", "30", "--debug.seed", "7", "--optimizer.lr", "3e-3",
               "--guard.enable", "--guard.max_events", "0") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the guard stopped the run at step" in errors[0], errors
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    events = [r for r in rows if "guard/event" in r]
    assert len(events) == 1 and 25 <= events[0]["step"] <= 30 and f"at step {events[0]['step']}:" in errors[0]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, events[0]["step"]))  # the spiking step is not logged as trained
