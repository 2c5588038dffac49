"""The spike guard's judgement (median + threshold x robust scale over the window; non-finite always), and a
real spike with no injection: a learning rate ramped up mid-run until training blows up is caught and, past
--guard.max_events, stops the run with one line. The FSDP 2 parity tests of its actions are in
tests/distributed/test_step_guard.py."""

import json
import math
import os

import pytest
import torch

from tests.unit.checkpoint_helpers import run
from torchtitan.components.step_guard import StepGuard
from torchtitan.config.job_config import Guard


class Rows:
    def __init__(self):
        self.rows = []

    def log(self, step, values, console=True):
        self.rows.append((step, values))


def judge(guard, step, loss, norm):
    return guard.judge(step, torch.tensor(loss), torch.tensor(norm))


def test_window_median_and_mad_decide():
    guard = StepGuard(Guard(enable=True, window=4, threshold=6.0))
    for step, loss in enumerate([5.0, 5.2, 4.8, 5.1], 1):  # the window fills; nothing is judged a spike yet
        assert judge(guard, step, loss, 1.0) is None
    # median 5.05, MAD 0.1 -> limit 5.05 + 6 x 1.4826 x 0.1 = 5.94
    assert judge(guard, 5, 5.9, 1.0) is None
    # the window is now 5.2, 4.8, 5.1, 5.9: median 5.15, MAD 0.2 -> limit 6.929
    event = judge(guard, 6, 7.0, 1.0)
    assert (event.step, event.metric, event.action) == (6, "loss", "skip")
    assert math.isclose(event.limit, 5.15 + 6 * 1.4826 * 0.2, rel_tol=1e-6)  # the values are judged as float32
    assert list(guard.history["loss"]) == pytest.approx([5.2, 4.8, 5.1, 5.9], rel=1e-6)  # an event does not join the history
    assert judge(guard, 6, 6.9, 1.0) is None
    # The gradient norm of a flat curve (MAD 0): the 1% floor of the scale keeps noise from being a spike.
    assert judge(guard, 7, 5.0, 1.05) is None
    assert judge(guard, 7, 5.0, 1.2).metric == "grad_norm"
    nan = judge(guard, 8, 5.0, float("nan"))
    assert nan.metric == "grad_norm" and math.isinf(nan.value) and math.isnan(nan.limit)
    rows = Rows()
    guard.record(nan, rows)
    assert rows.rows == [(8, {"guard/event": 1, "guard/grad_norm": math.inf, "guard/limit": nan.limit,
                              "guard/skip": 1})]


def test_a_real_spike_is_caught_and_the_limit_stops_the_run(tmp_path, capsys):
    """The LR warms up to 0.3 over 12 steps (far too high for this model): the gradient norm climbs out of
    its window's range before the loss blows up."""
    assert run(tmp_path, "--training.steps", "14", "--optimizer.lr", "0.3", "--lr_scheduler.warmup_steps", "12",
               "--guard.enable", "--guard.window", "4", "--guard.max_events", "0", "--debug.seed", "7") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the guard stopped the run at step" in errors[0], errors
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    events = [r for r in rows if "guard/event" in r]
    assert len(events) == 1 and f"at step {events[0]['step']}:" in errors[0]
    trained = [r["step"] for r in rows if "loss" in r]
    assert trained == list(range(1, events[0]["step"]))  # the spiking step is not logged as trained
