"""A document source that keeps failing on one rank (DP 2): that rank retries with backoff, then stops with one
line naming the source; the other rank, waiting in a collective for it, ends within the retry budget plus a few
seconds, not at the collective's timeout; and the failure is one the restart supervisor restarts. A peer that
SIGTERM cannot stop (as in a NCCL wait) is killed by the launcher PEER_GRACE_S after the report."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.e2e.test_run_train import ROOT
from tests.multiprocess import free_port
from torchtitan.tools.restart import read_failure

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

RETRIES, BACKOFF_S = 2, 0.5  # waits 0.5 s + 1 s before giving up
SLACK_S = 10.0  # measured 4.0-9.3 s in all on 2 shared cores (load 14): rank 1 closing, rank 0 erroring, torchrun


def test_a_source_that_keeps_failing_ends_every_rank_with_one_line(tmp_path):
    stamp, failures = tmp_path / "first_failure", tmp_path / "failures"
    failures.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLAKY_FAIL_FROM="6", FLAKY_RANK="1",
               FLAKY_STAMP=str(stamp), TORCHTITAN_FAILURE_DIR=str(failures))
    cmd = [sys.executable, "-m", "torchtitan.launch", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1",
           str(ROOT / "tests" / "e2e" / "flaky_source_train.py"),
           "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--parallelism.data_parallel_shard_degree", "2", "--training.steps", "20", "--metrics.log_freq", "1",
           "--training.dataset", "flaky", "--training.source_retries", str(RETRIES),
           "--training.source_retry_backoff_s", str(BACKOFF_S), "--comm.train_timeout_seconds", "300",
           "--job.dump_folder", str(tmp_path / "run")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ended = time.time()
    out = p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 1, out
    assert re.search(r"\[rank 0\] \[titan\].*step:\s+2\s", p.stdout), out  # it trained before the source failed
    # Every rank has ended (the launcher waits for all) well before the collective's 300 s timeout.
    budget = BACKOFF_S * (2**RETRIES - 1)
    took = ended - float(stamp.read_text())
    reports = {f.name: json.loads(f.read_text())["time"] for f in failures.glob("rank-*.json")}
    print(f"first failure -> every rank ended: {took:.1f} s (retry budget {budget:.1f} s); reports at "
          + ", ".join(f"{k} +{v - float(stamp.read_text()):.1f} s" for k, v in sorted(reports.items())))
    assert took < budget + SLACK_S, out
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: data source flaky failed 3 times in a row reading document 6 (OSError: connection reset by peer); "
        "restarting the run resumes there (more tries: --training.source_retries)"
    ], out
    assert "Traceback" not in p.stdout + p.stderr, out  # not even rank 0's, whose collective broke
    failure = read_failure(str(failures))
    assert failure.restartable and "data source flaky" in failure.signature  # tools/restart.py restarts it


STUCK_PEER = """
import os, signal, sys, time
from torchtitan.tools.restart import record_failure
if os.environ["RANK"] == "1":
    record_failure("data source web failed 4 times in a row reading document 7", user_error=True)
    sys.exit(1)
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank blocked in C (a NCCL wait) runs no Python handler
time.sleep(300)
"""


def test_a_peer_that_sigterm_cannot_stop_is_killed_after_the_grace(tmp_path):
    from torchtitan.launch import PEER_GRACE_S

    env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHTITAN_FAILURE_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "torchtitan.launch", "--nproc-per-node=2", "--max-restarts=0", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1", "--no-python", sys.executable,
           "-c", STUCK_PEER]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.time() - json.loads((tmp_path / "rank-1.json").read_text())["time"]
    print(f"rank 1's user error reported -> the stuck rank 0 killed, the launcher done: {took:.1f} s")
    assert p.returncode == 1, p.stderr[-3000:]
    assert [line for line in p.stderr.splitlines() if line.startswith("error:")] == [
        "error: data source web failed 4 times in a row reading document 7"], p.stderr[-3000:]
    # torchrun alone waits 30 s before it kills rank 0; the grace plus 15 s leaves room for a loaded machine.
    assert took < PEER_GRACE_S + 15, p.stderr[-3000:]
