"""Extending a finished run ("train a bit longer"): the same command with more --training.steps continues from
the last save instead of starting over, and a folder holding only a model-only export refuses in one line.

Losses and grad norms are compared bitwise (fp32, one process). The exact-parity runs use warmup then a
constant LR (decay_ratio 0), a schedule whose values do not depend on training.steps; the re-fit test checks
the LRs of an extended decaying schedule against the 20-step table of lr_scheduler.lr_factor.
"""

import json
import os

import pytest

from tests.unit.checkpoint_helpers import inventory, run
from torchtitan.components.optim.lr_scheduler import lr_factor

# Step 10 is not a multiple of the interval: only the last save can be resumed from.
SAVE = ["--checkpoint.enable", "--checkpoint.interval", "4"]
CONSTANT_AFTER_WARMUP = ["--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0"]
LR = 1e-3


def logged(folder) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "loss" in m]


def curve(steps: list[dict]) -> list[tuple]:
    return [(m["step"], m["loss"], m["grad_norm"], m["lr"]) for m in steps]


@pytest.fixture(scope="module")
def straight_20(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    assert run(folder, "--training.steps", "20", *SAVE, *CONSTANT_AFTER_WARMUP) == 0
    return logged(folder)


def test_rerun_with_more_steps_extends_the_run_bitwise(straight_20, tmp_path):
    assert run(tmp_path, "--training.steps", "10", *SAVE, *CONSTANT_AFTER_WARMUP) == 0
    root = tmp_path / "checkpoint"
    assert sorted(os.listdir(root)) == ["step-10", "step-4", "step-8"], "the last save is the full state"
    assert run(tmp_path, "--training.steps", "20", *SAVE, *CONSTANT_AFTER_WARMUP) == 0
    steps = logged(tmp_path)  # the first run's steps 1..10, then the extension's
    assert [m["step"] for m in steps] == list(range(1, 21)), "the extension resumed at step 11"
    assert curve(steps[10:]) == curve(straight_20[10:])


def test_extension_refits_a_decaying_schedule(tmp_path):
    decaying = ["--lr_scheduler.warmup_steps", "2", "--optimizer.lr", str(LR)]  # linear decay over all steps
    assert run(tmp_path, "--training.steps", "6", *SAVE, *decaying) == 0
    assert run(tmp_path, "--training.steps", "10", *SAVE, *decaying) == 0
    lrs = [m["lr"] for m in logged(tmp_path)]
    table = {t: [LR * lr_factor(s, warmup_steps=2, total_steps=t, decay_ratio=None, decay_type="linear",
                                 min_lr_factor=0.0) for s in range(t)] for t in (6, 10)}
    assert lrs[:6] == table[6]
    # Steps 7..10 follow the 10-step schedule from where the run stands (0.5 of peak at step 7), not the
    # 6-step one (which ended at 0) and not a restarted warmup.
    assert lrs[6:] == table[10][6:]
    assert lrs[6] == pytest.approx(0.5 * LR)


def test_export_only_folder_refuses_in_one_line_then_continues_as_told(tmp_path, capsys):
    assert run(tmp_path, "--training.steps", "2", *SAVE, "--checkpoint.last_save", "export_only") == 0
    export = str(tmp_path / "checkpoint" / "export-step-2")
    assert os.listdir(tmp_path / "checkpoint") == ["export-step-2"]
    before = inventory(tmp_path)
    capsys.readouterr()
    assert run(tmp_path, "--training.steps", "4", *SAVE) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, errors
    assert f"holds only the model-only export {export}" in errors[0]
    assert f"--checkpoint.initial_load_path {export} --checkpoint.initial_load_model_only" in errors[0]
    assert inventory(tmp_path) == before, "a refused run changes nothing"
    # The options the line names do continue from the export's weights (a fresh run of 4 steps).
    assert run(tmp_path, "--training.steps", "4", *SAVE, "--checkpoint.initial_load_path", export,
               "--checkpoint.initial_load_model_only") == 0
    assert [m["step"] for m in logged(tmp_path)][-4:] == [1, 2, 3, 4]
