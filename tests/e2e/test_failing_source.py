"""A document source that keeps failing on one rank (DP 2): that rank retries with backoff, then stops with one
line naming the source; the other rank, waiting in a collective for it, is ended by the launcher (torchrun stops
the job's other ranks once one exits) within the retry budget plus a few seconds, not at the collective's
timeout; and the failure is one the restart supervisor restarts."""

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
SLACK_S = 8.0  # measured 4.0 s on 2 shared cores (rank teardown, torchrun noticing, gloo erroring)


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
    print(f"first failure -> every rank ended: {took:.1f} s (retry budget {budget:.1f} s)")
    assert took < budget + SLACK_S, out
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: data source flaky failed 3 times in a row reading document 6 (OSError: connection reset by peer); "
        "restarting the run resumes there (more tries: --training.source_retries)"
    ], out
    failure = read_failure(str(failures))
    assert failure.restartable and "data source flaky" in failure.signature  # tools/restart.py restarts it
