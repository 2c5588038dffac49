"""Checkpoint manager behaviour in one process: what is saved, retention, async saves, seed checkpoints, and
bad input (each: one clear line, exit 1, nothing deleted)."""

import os
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from tests.unit.checkpoint_helpers import inventory, losses, run
from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.manager import CheckpointError, CheckpointManager, RNGState
from torchtitan.components.optim.lr_scheduler import build_lr_schedulers
from torchtitan.components.optim.optimizer import build_optimizers
from torchtitan.protocols.train_spec import config_manager
from torchtitan.components.train_state import TrainState

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2"]


@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    """4 steps, a checkpoint every step, keep 2, and the model-only export as well at the end."""
    folder = tmp_path_factory.mktemp("run")
    assert run(folder, "--training.steps", "4", *CKPT, "--checkpoint.last_save", "full_and_export") == 0
    return folder


def copy_run(done_run, tmp_path):
    shutil.copytree(os.path.join(done_run, "checkpoint"), os.path.join(tmp_path, "checkpoint"))
    return os.path.join(tmp_path, "checkpoint")


def test_retention_and_export(done_run):
    root = os.path.join(done_run, "checkpoint")
    assert sorted(os.listdir(root)) == ["export-step-4", "step-3", "step-4", folders.VERSIONS]
    for name in ("step-4", "export-step-4"):
        assert folders.problem(os.path.join(root, name)) is None
        assert os.path.isfile(os.path.join(root, name, "config.toml"))
    assert folders.read_manifest(os.path.join(root, "export-step-4"))["kind"] == "export"


def test_resume_from_latest(done_run, tmp_path):
    copy_run(done_run, tmp_path)
    assert run(tmp_path, "--training.steps", "5", *CKPT) == 0
    assert len(losses(tmp_path)) == 1  # step 5 only: resumed from step-4


def test_bf16_export_loads_as_initial_weights(done_run, tmp_path):
    assert run(tmp_path / "a", "--training.steps", "2", "--checkpoint.enable", "--checkpoint.interval", "5",
               "--checkpoint.last_save", "export_only", "--checkpoint.export_dtype", "bfloat16") == 0
    export = tmp_path / "a" / "checkpoint" / "export-step-2"
    from torchtitan.components.checkpoint.manager import read_dcp_metadata

    meta = read_dcp_metadata(str(export)).state_dict_metadata
    assert meta["model.output.weight"].properties.dtype == torch.bfloat16
    assert run(tmp_path / "b", "--training.steps", "1", "--checkpoint.initial_load_path", str(export)) == 0


def test_seed_checkpoint_gives_the_same_run(tmp_path):
    from torchtitan.create_seed_checkpoint import main as seed_main

    assert seed_main(["--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path / "seed")]) == 0
    seed = tmp_path / "seed" / "seed_checkpoint"
    assert folders.problem(str(seed)) is None
    assert run(tmp_path / "plain", "--training.steps", "2") == 0
    assert run(tmp_path / "seeded", "--training.steps", "2", "--checkpoint.initial_load_path", str(seed)) == 0
    assert losses(tmp_path / "plain") == losses(tmp_path / "seeded")


def test_seed_checkpoint_refuses_to_overwrite(tmp_path, capsys):
    from torchtitan.create_seed_checkpoint import main as seed_main

    argv = ["--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path)]
    assert seed_main(argv) == 0
    before = inventory(tmp_path)
    assert seed_main(argv) == 1
    assert "already exists" in capsys.readouterr().err
    assert inventory(tmp_path) == before


def test_rng_state_round_trip():
    rng = RNGState()
    saved = rng.state_dict()
    first = torch.rand(3)
    rng.load_state_dict(saved)
    assert torch.equal(torch.rand(3), first)


# ---- bad input: one line, exit 1, nothing deleted --------------------------------------------------------
def assert_refused(capsys, folder, argv, message):
    before = inventory(folder)
    assert run(folder, *argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], err
    after = inventory(folder)
    assert {k: after.get(k) for k in before} == before, "a refused run must not delete or change any file"


def test_other_model_shape(done_run, tmp_path, capsys):
    copy_run(done_run, tmp_path)
    assert_refused(capsys, tmp_path, ["--training.steps", "5", *CKPT, "--model.flavor", "debugmodel"],
                   "another model shape: layers.0.attention.wk.weight is [32, 64] there, [128, 256] here")


def test_missing_initial_folder(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert_refused(capsys, tmp_path, ["--training.steps", "1", "--checkpoint.initial_load_path", missing],
                   "no such folder")


def test_truncated_file_is_skipped_then_refused(done_run, tmp_path, capsys):
    root = copy_run(done_run, tmp_path)
    for step in (3, 4):
        with open(os.path.join(root, f"step-{step}", "__0_0.distcp"), "r+b") as f:
            f.truncate(100)
    # Both complete-looking folders are corrupt: refuse rather than silently restart from scratch.
    assert_refused(capsys, tmp_path, ["--training.steps", "5", *CKPT], "no usable checkpoint")
    assert_refused(capsys, tmp_path, ["--training.steps", "5", *CKPT, "--checkpoint.load_step", "4"],
                   "truncated or corrupt")


def test_corrupt_metadata(done_run, tmp_path, capsys):
    root = copy_run(done_run, tmp_path)
    export = os.path.join(root, "export-step-4")
    meta = os.path.join(export, ".metadata")
    size = os.path.getsize(meta)
    with open(meta, "wb") as f:
        f.write(b"\0" * size)  # same size: only its checksum (or reading it) can tell
    assert_refused(capsys, tmp_path, ["--training.steps", "1", "--checkpoint.initial_load_path", export],
                   f"--checkpoint.initial_load_path {export}: file .metadata does not match its checksum")


def test_model_only_checkpoint_for_a_full_load(done_run, tmp_path, capsys):
    root = copy_run(done_run, tmp_path)
    export = os.path.join(root, "export-step-4")
    assert_refused(capsys, tmp_path / "other", ["--training.steps", "1", "--checkpoint.initial_load_path", export,
                                                "--checkpoint.initial_load_model_only", "false"],
                   "holds no 'optimizer' state")


def test_another_optimizer_is_refused_unless_its_state_is_left_out(done_run, tmp_path, capsys):
    """AdamW's state loaded into Muon fails deep in DCP, into Adam it loads silently: both get one line that
    names the two optimizers, and leaving the optimizer state out continues with a fresh one."""
    copy_run(done_run, tmp_path)
    for other in ("Muon", "Adam"):
        assert_refused(capsys, tmp_path, ["--training.steps", "5", *CKPT, "--optimizer.name", other],
                       f"holds AdamW optimizer state but this run uses --optimizer.name {other}")
    assert run(tmp_path, "--training.steps", "5", *CKPT, "--optimizer.name", "Adam",
               "--checkpoint.exclude_from_loading", "optimizer") == 0
    assert len(losses(tmp_path)) == 1  # step 5 only: resumed from step-4's weights


def test_unknown_exclude_key(tmp_path, capsys):
    assert_refused(capsys, tmp_path, ["--training.steps", "1", "--checkpoint.enable",
                                      "--checkpoint.exclude_from_loading", "optimiser"], "unknown state 'optimiser'")


def test_pinned_memory_needs_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CPU-only message")
    assert_refused(capsys, tmp_path, ["--training.steps", "1", "--checkpoint.enable",
                                      "--checkpoint.async_mode", "async_with_pinned_mem"], "needs CUDA")


# ---- async saves ---------------------------------------------------------------------------------------
class _Position:
    def __init__(self):
        self.value = 0

    def state_dict(self):
        return {"doc_index": self.value}

    def load_state_dict(self, sd):
        self.value = sd["doc_index"]


def small_manager(folder, model):
    cfg = config_manager().parse_args(["--job.dump_folder", str(folder), "--checkpoint.enable",
                                      "--checkpoint.async_mode", "async"])
    optimizers = build_optimizers([model], cfg.optimizer)
    return CheckpointManager(cfg, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=build_lr_schedulers(optimizers, cfg.lr_scheduler, 10),
                             dataloader=SimpleNamespace(dataset=_Position()), train_state=TrainState())


@pytest.fixture
def gated_writes(monkeypatch):
    """Background writes wait until the test opens the gate."""
    gate = threading.Event()
    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        gate.wait(60)
        return real(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    return gate


def test_async_save_snapshots_state_and_completes_after_the_write(tmp_path, gated_writes):
    model = torch.nn.Linear(4, 4)
    saved = model.weight.detach().clone()
    manager = small_manager(tmp_path, model)
    manager.save(1, force=True)
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the write is in flight
    root = manager.root
    deadline = time.time() + 30
    partial = os.path.join(root, "step-1.partial")
    while not os.path.isdir(partial) and time.time() < deadline:  # the writer thread creates the folder
        time.sleep(0.05)
    assert os.listdir(root) == ["step-1.partial"], "not complete before the write finished"
    gated_writes.set()
    manager.close()
    assert os.listdir(root) == ["step-1"]
    fresh = torch.nn.Linear(4, 4)
    small_manager(tmp_path, fresh).load()
    assert torch.equal(fresh.weight.detach(), saved), "the save holds the state at save time"


def test_async_keeps_one_save_in_flight(tmp_path, gated_writes):
    manager = small_manager(tmp_path, torch.nn.Linear(4, 4))
    manager.save(1, force=True)
    threading.Timer(1.0, gated_writes.set).start()
    t0 = time.perf_counter()
    manager.save(2, force=True)  # waits for step 1's write, completes it, then starts step 2
    assert time.perf_counter() - t0 >= 0.9
    assert "step-1" in os.listdir(manager.root)
    manager.close()
    assert sorted(os.listdir(manager.root)) == ["step-1", "step-2"]


def test_failed_background_write_is_reported_and_kept(tmp_path, monkeypatch):
    def broken(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", broken)
    manager = small_manager(tmp_path, torch.nn.Linear(4, 4))
    manager.save(1, force=True)
    with pytest.raises(CheckpointError, match="background save of .*step-1 failed: .*OSError: disk full"):
        manager.close()
    assert os.listdir(manager.root) == ["step-1.partial"]


def test_data_position_saved_right_after_a_load_is_the_loaded_one():
    """A save between loading and the next step (e.g. preemption at once) must not mix in the old iterator's
    count (it used to report a mid-batch position that no layout could load)."""
    from tests.unit.test_packing import ListSource
    from torchtitan.components.tokenizer.backends import build_tokenizer
    from torchtitan.datasets.packing import GlobalBatchSlicer, TextWindows

    docs = TextWindows(ListSource([f"document number {i} " * 5 for i in range(40)]), build_tokenizer(None), 9, "loop")
    ds = GlobalBatchSlicer([docs], [1.0], global_batch_size=4, dp_rank=0, dp_degree=2)
    it = iter(ds)
    for _ in range(4):
        next(it)
    saved = ds.state_dict()
    assert saved["yielded"] == 0
    ds.load_state_dict(saved)
    assert ds.state_dict() == saved
