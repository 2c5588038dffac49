import functools
import logging
import math

import pytest
import torch
from torch import nn

from torchtitan.components.optim.lr_scheduler import build_lr_schedulers, decay_steps, lr_factor
from torchtitan.components.optim.optimizer import build_optimizers
from torchtitan.config.job_config import LRScheduler, Optimizer


def _factor(decay_type="linear", warmup=4, total=20, decay_ratio=None, min_lr=0.0):
    return functools.partial(
        lr_factor,
        warmup_steps=warmup,
        total_steps=total,
        decay_ratio=decay_ratio,
        decay_type=decay_type,
        min_lr_factor=min_lr,
    )


def test_warmup_starts_small_and_reaches_peak_at_its_last_step():
    f = _factor(warmup=4)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(0) > 0


@pytest.mark.parametrize(
    "decay_type, midpoint",
    [("linear", 0.5), ("sqrt", 1 - math.sqrt(0.5)), ("cosine", 0.5)],
)
def test_decay_boundaries(decay_type, midpoint):
    # warmup 4, decay over the 16 remaining steps: decay starts at step 4 with progress 0.
    f = _factor(decay_type, warmup=4, total=20, min_lr=0.1)
    assert f(3) == 1.0
    assert f(4) == pytest.approx(1.0)
    assert f(4 + 8) == pytest.approx(0.1 + 0.9 * midpoint)
    assert f(19) > 0.1  # the last trainer step still trains above the floor
    assert f(20) == pytest.approx(0.1)  # reached right after the last optimizer step
    assert f(100) == pytest.approx(0.1)


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_monotone_up_then_down(decay_type):
    f = _factor(decay_type, warmup=5, total=50, decay_ratio=0.4, min_lr=0.0)
    values = [f(s) for s in range(60)]
    assert all(a < b for a, b in zip(values[:4], values[1:5]))
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert all(v > 0 for v in values[:50])  # no step trains with a zero LR
    assert values[50] == 0.0


def test_wsd_stable_phase():
    # total 100, warmup 10, decay_ratio 0.2 -> stable on steps 10..79, decay on 80..99.
    f = _factor("cosine", warmup=10, total=100, decay_ratio=0.2)
    assert decay_steps(warmup_steps=10, total_steps=100, decay_ratio=0.2) == 20
    assert all(f(s) == 1.0 for s in range(9, 81))
    assert f(81) < 1.0


def test_decay_clamped_to_steps_after_warmup(caplog):
    assert decay_steps(warmup_steps=10, total_steps=20, decay_ratio=0.8) == 10
    opt = build_optimizers([nn.Linear(2, 2)], Optimizer(lr=1.0))
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        build_lr_schedulers(opt, LRScheduler(warmup_steps=10, decay_ratio=0.8), total_steps=20)
    assert "decaying over the last 10 steps" in caplog.text


def test_no_warmup():
    f = _factor(warmup=0, total=10)
    assert f(0) == 1.0
    assert f(5) == pytest.approx(0.5)


def test_invalid_config_rejected():
    opt = build_optimizers([nn.Linear(2, 2)], Optimizer())
    with pytest.raises(ValueError, match="decay_ratio"):
        build_lr_schedulers(opt, LRScheduler(decay_ratio=1.5), total_steps=10)
    with pytest.raises(ValueError, match="decay_type"):
        build_lr_schedulers(opt, LRScheduler(decay_type="step"), total_steps=10)


def _optimizers(lr: float, parts: int = 2):
    return build_optimizers([nn.Linear(2, 2) for _ in range(parts)], Optimizer(lr=lr))


def test_scheduler_drives_every_optimizer():
    opt = _optimizers(lr=1.0)
    sched = build_lr_schedulers(opt, LRScheduler(warmup_steps=4), total_steps=20)
    # Built: trainer step 1 trains with factor(0).
    assert sched.get_last_lr() == [0.25, 0.25]
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    for _ in range(3):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [1.0, 1.0]


def test_state_dict_round_trip():
    cfg = LRScheduler(warmup_steps=3, decay_ratio=0.5, decay_type="cosine", min_lr_factor=0.1)
    opt = _optimizers(lr=2.0)
    sched = build_lr_schedulers(opt, cfg, total_steps=12)
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    saved = dict(state)

    # A different pipeline split (one part) and a fresh, un-stepped optimizer.
    fresh_opt = _optimizers(lr=2.0, parts=1)
    fresh = build_lr_schedulers(fresh_opt, cfg, total_steps=12)
    fresh.load_state_dict(state)
    assert fresh_opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    for _ in range(7):
        opt.step()
        sched.step()
        fresh_opt.step()
        fresh.step()
        assert fresh.get_last_lr()[0] == sched.get_last_lr()[0]
    assert fresh.get_last_lr()[0] == pytest.approx(0.2)  # 2.0 x min_lr_factor at step 12
    assert state == saved  # loading must not consume the caller's dict
