"""scripts/runs/plot_metrics.py and scripts/runs/loss_compare.py on metrics.jsonl files written by the trainer's own
MetricsLogger."""

import json
import os
import struct
import sys

import pytest

from torchtitan.components.metrics import MetricsLogger
from torchtitan.config.job_config import Metrics
from torchtitan.tools.logging import logger

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "runs"))
import loss_compare  # noqa: E402
import plot_metrics  # noqa: E402


@pytest.fixture(autouse=True)
def quiet_console(monkeypatch):
    """The runs below log console lines; a handler an earlier test left on a closed stream must not answer."""
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "propagate", False)


def write_run(folder, losses, *, validation_at=None):
    logger = MetricsLogger(str(folder), Metrics(disable_color_printing=True), rank=0)
    for step, loss in losses.items():
        logger.log(step, {"loss": loss, "grad_norm": 1.0 / step, "lr": 1e-3, "tps": 1000.0 + step, "mfu": 12.5})
        if step == validation_at:
            logger.log(step, {"validation/loss": loss + 0.1})
    logger.close()
    return str(folder)


BASE = {1: 8.0, 5: 6.5, 10: 5.25, 15: 4.875, 20: 4.5}


def test_identical_runs_pass(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", BASE), write_run(tmp_path / "b", BASE)
    assert loss_compare.main([a, b]) == 0
    assert "identical at every compared step" in capsys.readouterr().out


def test_first_difference_is_reported_and_the_tolerance_decides(tmp_path, capsys):
    a = write_run(tmp_path / "a", BASE)
    b = write_run(tmp_path / "b", {**BASE, 10: 5.25 * (1 + 2e-6), 15: 4.875 * (1 + 3e-4)})
    assert loss_compare.main([a, b]) == 1  # 3e-4 is beyond the default rtol 1e-5
    out = capsys.readouterr().out
    assert "compared 5 steps (1..20)" in out
    assert "first difference at step 10: 5.25 vs 5.2500105" in out
    assert "BEYOND tolerance (rtol 1e-05, atol 0) first at step 15:" in out
    assert loss_compare.main([a, b, "--rtol", "1e-3"]) == 0
    out = capsys.readouterr().out
    assert "first difference at step 10" in out and "largest difference at step 15" in out
    assert "within tolerance (rtol 0.001, atol 0)" in out


def test_nan_in_one_run_is_beyond_any_tolerance(tmp_path, capsys):
    a = write_run(tmp_path / "a", BASE)
    b = write_run(tmp_path / "b", {**BASE, 20: float("nan")})
    assert loss_compare.main([a, b, "--rtol", "1"]) == 1
    assert "first at step 20: 4.5 vs nan" in capsys.readouterr().out


def test_unreadable_runs_exit_2_with_one_line(tmp_path, capsys):
    a = write_run(tmp_path / "a", BASE)
    assert loss_compare.main([a, str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'}: no metrics.jsonl (expected a run " \
                                              f"folder or a metrics.jsonl file)"
    b = write_run(tmp_path / "b", {100: 1.0})
    assert loss_compare.main([a, b]) == 2
    assert "logged the loss at no common step" in capsys.readouterr().err


def _png_size(path):
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_plot_writes_one_png_for_several_runs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = write_run(tmp_path / "a", BASE, validation_at=20)
    b = write_run(tmp_path / "b", {s: v * 1.1 for s, v in BASE.items()})
    out = tmp_path / "plot.png"
    assert plot_metrics.main([a, os.path.join(b, "metrics.jsonl"), "-o", str(out), "--label", "fsdp",
                              "--label", "tp"]) == 0
    width, height = _png_size(out)
    assert width > 4 * height  # five panels side by side
    # A run that logged evaluations gets a sixth panel with its scores.
    with open(os.path.join(a, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 20, "eval/t/acc": 0.5, "eval/t/acc_stderr": 0.1, "eval/t/requests": 8,
                            "eval/t/rows": 2}) + "\n")
    assert plot_metrics.eval_scores([plot_metrics.read_metrics(a)]) == ["eval/t/acc"]
    assert plot_metrics.main([a, "-o", str(out)]) == 0
    width6, height6 = _png_size(out)
    assert width6 > width * 1.1
    assert plot_metrics.main([str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
