"""Faults of the object store itself, on a real S3-speaking server (moto, in this process so that it can be
stopped and started again with its objects kept), with one-process runs of the tiny model:

* the server down for 10 s in the middle of an async save: the upload is retried with backoff and the save
  completes, while training goes on (steps are logged during the outage);
* the same outage with a retry budget of 3 s: the save fails with one line naming the checkpoint and the
  cause, the previous checkpoint is intact and is where the next run resumes;
* a listing that lacks the newest checkpoint (a lagging listing): `latest.json` names it, its manifest decides,
  and the run resumes from it; without the pointer it would have resumed from the older one (the control); a
  folder listing that lacks a data file: the manifest still lists it (from the writers' records);
* pre-flight: a missing bucket, an unreachable store and denied writes are one line each before any rank starts;
* initial weights from a checkpoint on the store (Hugging Face folders, seeds and exports on a store:
  test_object_storage_state.py).
(The resume, retention and checksum tests run on both a local folder and the S3 server: test_checkpoint_*.py.)
"""

import json
import os
import threading
import time

import pytest

from tests.unit.checkpoint_helpers import losses, run
from torchtitan.tools import storage
from torchtitan.components.checkpoint import folders

pytest.importorskip("s3fs", reason="needs s3fs (pip install 'torchtitan[test]')")
pytest.importorskip("moto.server", reason="needs moto[server] (pip install 'torchtitan[test]')")

BUCKET = "faults"
ROOT = f"s3://{BUCKET}/ckpt"


@pytest.fixture
def s3(monkeypatch):
    """A server of this test's own, emptied first (moto keeps objects per process, across its servers)."""
    from tests.s3_server import ThreadedS3Server, environment, make_bucket

    server = ThreadedS3Server()
    server.reset()
    for k, v in environment(server.endpoint).items():
        monkeypatch.setenv(k, v)
    storage.reset_clients()
    make_bucket(server.endpoint, BUCKET)
    yield server
    server.stop()
    storage.reset_clients()


def ckpt(*extra):
    return ["--checkpoint.enable", "--checkpoint.folder", ROOT, "--checkpoint.keep_latest_k", "0", *extra]


def logged_steps(folder) -> int:
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if '"loss"' in line)


def outage_at(monkeypatch, server, folder, name: str, seconds: float) -> dict:
    """Stops the server just before the first upload of a file whose URL contains `name`, for `seconds`;
    records how many steps training had logged when the server came back (`logged_at_restart`). The save cannot
    finish before then, so every step past the saved one counted there trained while the save was in flight
    (counting only the steps logged inside the outage raced the upload's start: the async upload may begin only
    after training reached the next blocking point)."""
    seen: dict = {}
    real = storage.upload_file

    def restart():
        seen["logged_at_restart"] = logged_steps(folder)
        server.start()

    def upload(local, url):
        if name in url and "timer" not in seen:
            server.stop()
            seen["timer"] = threading.Timer(seconds, restart)
            seen["timer"].start()
        return real(local, url)

    monkeypatch.setattr(storage, "upload_file", upload)
    return seen


def test_store_down_for_10s_mid_save_retries_and_completes(s3, tmp_path, monkeypatch, caplog):
    seen = outage_at(monkeypatch, s3, tmp_path, "step-4/__0_0.distcp", 10.0)
    assert run(tmp_path, "--training.steps", "8", *ckpt("--checkpoint.interval", "4", "--checkpoint.async_mode",
                                                         "async", "--job.storage_retry_seconds", "60")) == 0
    seen["timer"].join()
    assert "retrying for up to 60s" in caplog.text  # the retry loop, not luck, carried the save
    assert seen["logged_at_restart"] >= 7, seen  # steps 5-7 trained while step 4 was being written
    for step in (4, 8):
        assert folders.problem(folders.step_folder(ROOT, step)) is None
    assert folders.latest_pointer(ROOT) == 8
    # The run's record travels with the checkpoints: metrics up to the last save, the resolved config.
    mirrored = storage.read_bytes(storage.join(ROOT, "run", "metrics.jsonl")).decode()
    with open(tmp_path / "metrics.jsonl") as f:
        assert f.read().startswith(mirrored) and mirrored.count('"loss"') >= 4
    assert storage.isfile(storage.join(ROOT, "run", "config.toml"))


def test_store_down_longer_than_the_budget_fails_in_one_line(s3, tmp_path, monkeypatch, capsys):
    seen = outage_at(monkeypatch, s3, tmp_path, "step-4/__0_0.distcp", 10.0)
    code = run(tmp_path, "--training.steps", "8", *ckpt("--checkpoint.interval", "2", "--checkpoint.async_mode",
                                                        "async", "--job.storage_retry_seconds", "3"))
    seen["timer"].join()
    assert code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"background save of {ROOT}/step-4 failed" in errors[0] \
        and "the store did not answer" in errors[0], errors
    assert seen["logged_at_restart"] >= 5, seen  # training went on while the save was retried
    assert folders.problem(folders.step_folder(ROOT, 2)) is None  # the previous checkpoint is intact
    assert folders.problem(folders.step_folder(ROOT, 4)) is not None
    monkeypatch.undo()
    os.remove(tmp_path / "metrics.jsonl")
    assert run(tmp_path, "--training.steps", "3", *ckpt("--checkpoint.interval", "2")) == 0
    assert len(losses(tmp_path)) == 1  # step 3 only: resumed from step-2


def test_listing_without_the_newest_checkpoint(s3, tmp_path, monkeypatch, caplog):
    real_sizes = storage.file_sizes

    def lagging_sizes(folder):  # every folder listing lacks the data file written last
        return {k: v for k, v in real_sizes(folder).items() if k != "__0_0.distcp"}

    monkeypatch.setattr(storage, "file_sizes", lagging_sizes)
    assert run(tmp_path / "a", "--training.steps", "4", *ckpt("--checkpoint.interval", "2")) == 0
    manifest = folders.read_manifest(folders.step_folder(ROOT, 4))
    assert "__0_0.distcp" in manifest["files"], "the manifest lists what the writers wrote, not what a listing saw"
    real = storage.listdir

    def lagging(path):  # the listing of the run's root has not caught up with step-4 yet
        names = real(path)
        return [n for n in names if n != "step-4"] if path.rstrip("/") == ROOT else names

    monkeypatch.setattr(storage, "listdir", lagging)
    assert folders.named_steps(ROOT) == [2]
    assert run(tmp_path / "b", "--training.steps", "5", *ckpt("--checkpoint.interval", "2")) == 0
    assert f"Resumed from {ROOT}/step-4" in caplog.text
    assert len(losses(tmp_path / "b")) == 1  # step 5 only

    # The control: without the pointer the lagging listing alone would have sent the run back to step 2.
    storage.remove(storage.join(ROOT, folders.LATEST))
    storage.remove_tree(folders.step_folder(ROOT, 5))
    caplog.clear()
    assert run(tmp_path / "c", "--training.steps", "5", *ckpt("--checkpoint.interval", "100",
                                                              "--checkpoint.last_save", "export_only")) == 0
    assert f"Resumed from {ROOT}/step-2" in caplog.text


def test_preflight_names_a_missing_bucket_an_unreachable_store_and_denied_writes(s3, tmp_path, capsys,
                                                                                 monkeypatch):
    from tests.s3_server import free_port
    from torchtitan.preflight import main as preflight

    base = ["--model.flavor", "debugmodel_tiny", "--job.dump_folder", str(tmp_path), "--checkpoint.enable"]
    assert preflight([*base, "--checkpoint.folder", ROOT]) == 0
    assert preflight([*base, "--checkpoint.folder", "s3://no-such-bucket/run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --checkpoint.folder s3://no-such-bucket/run: the bucket does not exist (The specified "
                   "bucket does not exist); create it or fix the URL"], err
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    storage.reset_clients()
    t0 = time.monotonic()
    assert preflight([*base, "--checkpoint.folder", ROOT]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--checkpoint.folder {ROOT}: the store cannot be reached" in err[0], err
    assert time.monotonic() - t0 < 30  # one attempt: pre-flight reports at once
    assert json.dumps(err).count("testing") == 0  # no credential in the line

    from tests.s3_server import S3Server, make_bucket

    strict = S3Server(env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"})  # the bucket is made, then writes are denied
    try:
        make_bucket(strict.endpoint, "denied")
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        storage.reset_clients()
        assert preflight([*base, "--checkpoint.folder", "s3://denied/run"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--checkpoint.folder s3://denied/run: access denied writing a test object" in err[0]
    finally:
        strict.stop()


def test_initial_weights_from_a_checkpoint_on_the_store(s3, tmp_path, caplog):
    """--checkpoint.initial_load_path may name a DCP checkpoint on the store (here a model-only export)."""
    assert run(tmp_path / "a", "--training.steps", "2", *ckpt("--checkpoint.interval", "100",
                                                              "--checkpoint.last_save", "export_only")) == 0
    export = f"{ROOT}/export-step-2"
    assert folders.problem(export) is None
    assert run(tmp_path / "b", "--training.steps", "1", "--checkpoint.initial_load_path", export) == 0
    assert f"Loaded initial weights from {export}" in caplog.text
