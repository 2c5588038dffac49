"""Fault-tolerant replica groups (torchft): a group dies, the other trains on; the group comes back and copies
the live group's state, after which both hold exactly the same weights.

Two replica groups, each its own `torchrun` (1 rank, gloo), meet at a torchft lighthouse in this process.
Group 1 is SIGKILLed in step 4 (fault injection) and restarted by the supervisor (tools/restart.py); group 0
sleeps 1.2 s per step so it is still training when group 1 returns (its restart takes seconds). The test checks that group 0 ran once
(steps 1..N logged without a gap or a resume), that group 1's second attempt copied a live peer's state and then
continued from that step, and that both groups' last checkpoints hold bitwise-equal weights. The silent-corruption
check runs every 5 steps across the groups: it raises no alarm over the run, heal included, and its last check
compared both groups.

The second test flips a bit of group 1's weights at a seeded step: the next check names that group's rank.
"""

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.distributed.trainer_runs import read_metrics
from tests.multiprocess import free_port

torchft = pytest.importorskip("torchft")
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

STEPS = 25


# The shipped task's first 6 documents (24 requests) fit the 32-token window; both groups score all of them at the
# last step, so equal weights must give equal scores (a group that scored only its data shard would not).
EVAL = ["--eval.enable", "--eval.tasks", "stdlib_next_line", "--eval.limit", "6", "--eval.freq", "1000"]


def _group(replica_id: int, folder: str, faults: list[dict], lighthouse: str, steps: int = STEPS,
           groups: int = 2, store_port: int | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """One replica group of one rank: under the restart supervisor and torchrun, or, given the port of a TCPStore
    the caller hosts (torchft's Manager needs one), as a bare process (cheaper: two fewer interpreters)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHFT_LIGHTHOUSE": lighthouse,
           "TORCHTITAN_FAULTS": json.dumps(faults)}
    launch = [sys.executable, "-m", "torchtitan.tools.restart", "--max-restarts", "1", "--",
              sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--max-restarts=0",
              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}"]
    if store_port is not None:
        launch = [sys.executable]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store_port))
    cmd = [*launch, "-m", "torchtitan.train", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
           "--training.local_batch_size", "2", "--training.steps", str(steps),
           "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--debug.seed", "7",
           "--debug.deterministic", "--checkpoint.enable", "--checkpoint.interval", "1000",
           "--fault_tolerance.enable", "--fault_tolerance.replica_id", str(replica_id),
           "--fault_tolerance.group_size", str(groups), "--fault_tolerance.timeout_seconds", "5",
           "--guard.replica_check_interval", "5", "--job.dump_folder", folder, *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _export(folder: str) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(os.path.join(folder, "checkpoint", f"step-{STEPS}"), os.path.join(folder, "final.pt"))
    return torch.load(os.path.join(folder, "final.pt"), weights_only=False)["model"]  # the last (full) save


def test_replica_group_dies_and_rejoins(tmp_path):
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000)
    try:
        g0 = _group(0, str(tmp_path / "g0"), [{"kind": "sleep", "seconds": 1.2}], lighthouse.address(), extra=EVAL)
        g1 = _group(1, str(tmp_path / "g1"), [{"kind": "kill_rank", "step": 4, "attempt": 0}], lighthouse.address(),
                    extra=EVAL)
        out1, _ = g1.communicate(timeout=400)
        out0, _ = g0.communicate(timeout=400)
    finally:
        lighthouse.shutdown()
    assert g0.returncode == 0, out0[-4000:]
    assert g1.returncode == 0, out1[-4000:]
    steps0 = [m["step"] for m in read_metrics(str(tmp_path / "g0")) if "loss" in m]
    assert steps0 == list(range(1, STEPS + 1)), "the live group must train on without a restart"
    assert "restart: attempt 0 failed" in out1
    second = out1.split("restart: attempt 0 failed", 1)[1]
    healed = [int(s) for s in re.findall(r"copied the training state of a live replica group at step (\d+)", second)]
    assert healed and healed[-1] >= 4, out1[-4000:]
    for out in (out0, out1):
        assert f"silent-corruption check at step {STEPS}: replica groups [0, 1] agree" in out, out[-4000:]
    steps1 = [m["step"] for m in read_metrics(str(tmp_path / "g1")) if "loss" in m]
    assert steps1[-(STEPS - healed[-1]):] == list(range(healed[-1] + 1, STEPS + 1))
    w0, w1 = _export(str(tmp_path / "g0")), _export(str(tmp_path / "g1"))
    assert w0.keys() == w1.keys()
    for k in w0:
        assert torch.equal(w0[k], w1[k]), f"{k} differs between the replica groups"
    scores = [{k: v for k, v in m.items() if k.startswith("eval/") and not k.endswith("/seconds")}
              for g in ("g0", "g1") for m in read_metrics(str(tmp_path / g)) if m["step"] == STEPS]
    scores = [m for m in scores if m]
    assert len(scores) == 2 and scores[0]["eval/stdlib_next_line/requests"] == 24, scores
    assert scores[0] == scores[1], "equal weights, the same task: each group must score all of it"


def test_flipped_bit_in_one_group_is_named(tmp_path):
    from torchft.coordination import LighthouseServer

    rng = random.Random(int(os.environ.get("TORCHTITAN_FAULT_SEED", "0")))
    bad, flip = rng.randrange(3), rng.randrange(6, 11)  # after the check at step 5, found by the one at step 10
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=3, join_timeout_ms=1000)  # all groups from step 1
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(3)]
    try:  # three groups, so that a majority tells which one is wrong
        procs = [_group(g, str(tmp_path / f"g{g}"), [{"kind": "flip_bit", "step": flip, "rank": 0,
                                                      "bit": rng.randrange(23)}] if g == bad else [],  # mantissa
                        lighthouse.address(), steps=10, groups=3, store_port=stores[g].port) for g in range(3)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        lighthouse.shutdown()
    good = ", ".join(f"0 of replica group {g}" for g in range(3) if g != bad)
    for out, proc in zip(outs, procs):  # every group takes the same decision and stops (not restarted)
        assert proc.returncode != 0, out[-4000:]
        assert "silent-corruption check at step 5: replica groups [0, 1, 2] agree" in out, out[-4000:]
        assert (f"silent-corruption check at step 10: data-parallel replicas differ: rank(s) 0 of replica group {bad} "
                f"disagree with rank(s) {good} on their parameters; stopping") in out, out[-4000:]
        assert "Traceback" not in out  # one line, no stack
