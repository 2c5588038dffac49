"""Checkpoints resume runs exactly and across layouts, and a killed save never gets loaded.

* Same layout, fp32: 20 steps straight and 10 + preemption (SIGTERM) + resume + 10 log bit-identical losses
  and grad norms (single process, sync save; FSDP 2, async save).
* Another layout: a run preempted under FSDP 4 resumes under TP 2 x FSDP 2 and under one process; the next 10
  steps match the uninterrupted single-process run within the 2D parity tolerances (test_parity_2d.py). The
  negative control resumes without the data loader state (samples repeat) and must fail that check.
* Pipeline: a run preempted under PP 2 resumes in one process, and a single-process checkpoint resumes under
  PP 2 (parameter names are the unsplit model's, so the checkpoint does not care), within the same tolerances.
* Extension: a run finished under FSDP 2 and rerun with more steps in one process continues where it ended.
* Fault: a run SIGKILLed while its async save of step 10 is being written resumes from step 5, reports the
  unfinished folder, and continues bit-identically; on a local folder and on the S3 server.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import PARITY_ARGS, curves, read_metrics, train
from torchtitan.tools import storage
from torchtitan.components.checkpoint import folders

pytestmark = pytest.mark.distributed

STEPS = ["--training.steps", "20", "--checkpoint.enable", "--checkpoint.interval", "5"]
SINGLE = (1, ["--training.local_batch_size", "4"])
FSDP2 = (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"])
FSDP4 = (4, ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"])
TP2_FSDP2 = (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                 "--training.local_batch_size", "4"])
PP2 = (2, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"])
ASYNC = ["--checkpoint.async_mode", "async"]


def _sigterm_after_step_10(rank, world_size):
    """Preempts the run: rank 0 alone gets SIGTERM during step 10 (the ranks must agree to stop together)."""
    from torchtitan.trainer import Trainer

    real = Trainer.train_step

    def train_step(self, microbatches):
        out = real(self, microbatches)
        if rank == 0 and self.train_state.step + 1 == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    Trainer.train_step = train_step


def preempted_at_10(layout, extra, folder):
    world, argv = layout
    steps, _ = train(world, argv + STEPS + extra, folder, setup=_sigterm_after_step_10)
    assert [m["step"] for m in steps] == list(range(1, 11)), "SIGTERM must stop the run after step 10"
    assert os.path.isfile(os.path.join(folder, "checkpoint", "step-10", "manifest.json"))
    return steps


def resume(layout, extra, folder):
    world, argv = layout
    steps, _ = train(world, argv + STEPS + extra, folder)
    return steps


def assert_identical(a, b):
    la, ga = curves(a)
    lb, gb = curves(b)
    assert torch.equal(la, lb), f"losses differ:\n{la.tolist()}\n{lb.tolist()}"
    assert torch.equal(ga, gb), f"grad norms differ:\n{ga.tolist()}\n{gb.tolist()}"


@pytest.fixture(scope="module")
def straight_single(tmp_path_factory):
    steps, _ = train(SINGLE[0], SINGLE[1] + STEPS, str(tmp_path_factory.mktemp("straight_single")))
    assert len(steps) == 20
    return steps


@pytest.fixture(scope="module")
def fsdp4_preempted(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp4"))
    return folder, preempted_at_10(FSDP4, [], folder)


def test_exact_resume_single_process(straight_single, tmp_path):
    preempted_at_10(SINGLE, [], str(tmp_path))
    steps = resume(SINGLE, [], str(tmp_path))  # metrics.jsonl now holds steps 1..10 then 11..20
    assert [m["step"] for m in steps] == list(range(1, 21))
    assert_identical(steps, straight_single)


def test_exact_resume_fsdp2_async(tmp_path_factory):
    straight, _ = train(FSDP2[0], FSDP2[1] + STEPS + ASYNC, str(tmp_path_factory.mktemp("straight_fsdp2")))
    folder = str(tmp_path_factory.mktemp("resumed_fsdp2"))
    preempted_at_10(FSDP2, ASYNC, folder)
    steps = resume(FSDP2, ASYNC, folder)
    assert_identical(steps, straight)


def _copy_checkpoint(source: str, folder: str) -> None:
    shutil.copytree(os.path.join(source, "checkpoint"), os.path.join(folder, "checkpoint"))


def _resume_in(layout, fsdp4_preempted, folder, extra=()):
    _copy_checkpoint(fsdp4_preempted[0], folder)
    steps = resume(layout, list(extra), folder)
    assert [m["step"] for m in steps] == list(range(11, 21))
    return steps


def test_fsdp4_run_matches_before_preemption(fsdp4_preempted, straight_single):
    _, steps = fsdp4_preempted
    assert_parity(curves(steps), curves(straight_single[:10]))


@pytest.mark.parametrize("layout", ["tp2_fsdp2", "single"])
def test_resume_under_another_layout(layout, fsdp4_preempted, straight_single, tmp_path):
    target = {"tp2_fsdp2": TP2_FSDP2, "single": SINGLE}[layout]
    steps = _resume_in(target, fsdp4_preempted, str(tmp_path))
    assert_parity(curves(steps), curves(straight_single[10:]))


@pytest.mark.parametrize("direction", ["pp2_to_single", "single_to_pp2"])
def test_checkpoint_moves_between_pipelined_and_plain_runs(direction, straight_single, tmp_path):
    source, target = (PP2, SINGLE) if direction == "pp2_to_single" else (SINGLE, PP2)
    first = str(tmp_path / "first")
    before = preempted_at_10(source, [], first)
    assert_parity(curves(before), curves(straight_single[:10]))
    second = str(tmp_path / "second")
    _copy_checkpoint(first, second)
    steps = resume(target, [], second)
    assert [m["step"] for m in steps] == list(range(11, 21))
    assert_parity(curves(steps), curves(straight_single[10:]))


def test_resharding_check_catches_lost_data_position(fsdp4_preempted, straight_single, tmp_path):
    """The check has teeth: resuming without the data loader state replays the first batches and fails it."""
    steps = _resume_in(SINGLE, fsdp4_preempted, str(tmp_path), ["--checkpoint.exclude_from_loading", "dataloader"])
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), curves(straight_single[10:]))


def _run_cli(module, argv, folder, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHTITAN_TEST_STALL_STEP": "10"}
    cmd = [sys.executable, "-m", module, *PARITY_ARGS, *SINGLE[1], *STEPS, *argv, "--job.dump_folder", folder]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_killed_during_async_save_resumes_from_last_complete(straight_single, tmp_path, store):
    """On a local folder and on the S3 server (store): killed after step 10's data files were written but
    before its manifest, the run resumes from step 5 and continues bit-identically."""
    folder = str(tmp_path)
    root = store.root(folder)
    unfinished = "step-10.partial" if store.kind == "local" else "step-10"
    proc = _run_cli("tests.distributed.stalled_save_train", ASYNC + store.argv, folder)
    try:
        deadline = time.time() + 400
        while time.time() < deadline and proc.poll() is None:
            logged = read_metrics(folder) if os.path.exists(os.path.join(folder, "metrics.jsonl")) else []
            # Training went on while step 10 was being written: the save blocks only for staging.
            if storage.isdir(storage.join(root, unfinished)) and logged and logged[-1]["step"] >= 12:
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended early:\n{proc.stdout.read()}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = storage.listdir(root)
    assert [n for n in names if n.startswith("step-")] == sorted([unfinished, "step-5"]), names
    assert folders.problem(storage.join(root, "step-5")) is None, "only the finished save may look complete"
    assert folders.problem(storage.join(root, unfinished)) is not None
    before = len(read_metrics(folder))

    proc = _run_cli("torchtitan.train", store.argv, folder)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    if store.kind == "local":
        assert "Ignoring unfinished checkpoint(s) step-10.partial" in out
    else:  # the data files are there, the manifest never arrived: skipped with a warning, left for inspection
        assert f"Skipping checkpoint {root}/step-10: no manifest.json (the save did not finish)" in out
    assert f"Resumed from {root}/step-5" in out
    resumed = read_metrics(folder)[before:]
    assert [m["step"] for m in resumed] == list(range(6, 21))
    assert_identical(resumed, straight_single[5:])


def test_finished_run_extends_under_another_layout(tmp_path):
    """A run finished under FSDP 2 (5 steps; the last save is the full state) is extended to 10 steps in one
    process: steps 6-10 match a straight 10-step single-process run within the 2D-parity tolerances. Warmup then
    a constant LR (decay_ratio 0) gives both runs the same LR at every step."""
    common = ["--checkpoint.enable", "--checkpoint.interval", "100", "--lr_scheduler.decay_ratio", "0"]
    straight, _ = train(SINGLE[0], SINGLE[1] + common + ["--training.steps", "10"], str(tmp_path / "straight"))
    folder = str(tmp_path / "extended")
    train(FSDP2[0], FSDP2[1] + common + ["--training.steps", "5"], folder)
    assert sorted(os.listdir(os.path.join(folder, "checkpoint"))) == ["step-5"]
    steps = resume(SINGLE, common + ["--training.steps", "10"], folder)
    assert [m["step"] for m in steps] == list(range(1, 11))  # the FSDP 2 run's 1..5, then the extension's 6..10
    assert_parity(curves(steps[5:]), curves(straight[5:]))
