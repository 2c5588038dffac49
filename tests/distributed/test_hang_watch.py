"""Hang diagnosis names the stuck rank and the collective, within the configured time plus a few seconds.

Two gloo ranks train; rank 1 sleeps 8 s in the middle of step 3 (fault injection) while rank 0 goes on into the
step's next collective. With --comm.hang_timeout_seconds 2, rank 0 must report, about 2 s after it started
waiting (well before the sleep ends), the collective by per-group sequence number and name and that rank 1 has
not arrived, and both ranks must dump their Python stacks; rank 1's stack shows where it is (the sleep).
"""

import json
import os
import re

import pytest
import torch

from tests.distributed.trainer_runs import train
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT = 2.0
SLEEP = 8.0


def _stall_rank_1(rank, world_size):
    os.environ["TORCHTITAN_FAULTS"] = json.dumps([{"kind": "sleep", "step": 3, "rank": 1, "seconds": SLEEP}])


def test_hang_report_names_the_missing_rank_and_collective(tmp_path):
    argv = ["--training.steps", "4", "--parallelism.data_parallel_shard_degree", "2",
            "--training.local_batch_size", "4", "--comm.hang_timeout_seconds", str(TIMEOUT)]
    steps, _ = train(2, argv, str(tmp_path), setup=_stall_rank_1)
    assert [m["step"] for m in steps] == [1, 2, 3, 4], "the run goes on once the slow rank arrives"
    folder = tmp_path / "hang"
    assert sorted(os.listdir(folder)) == ["rank-0.txt", "rank-1.txt"]
    report = (folder / "rank-0.txt").read_text()
    m = re.search(r"hang: rank 0 has waited (\d+)s in collective #(\d+) (\S+) on group \S+ \(ranks 0, 1\); "
                  r"not arrived: rank\(s\) 1 \(rank 1: at #(\d+) on that group", report)
    assert m, report[:2000]
    waited, seq, name, behind_at = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4))
    assert TIMEOUT <= waited <= TIMEOUT + 3, f"reported after {waited}s, configured {TIMEOUT}s"
    assert behind_at == seq - 1 and name.endswith("all_reduce"), report[:2000]
    stack = (folder / "rank-1.txt").read_text()
    assert "in point" in stack and "fault_injection.py" in stack, stack[:3000]  # rank 1's own frame: the sleep
    assert "in train_step" in (folder / "rank-0.txt").read_text()  # rank 0's stack: inside the step's collective


def _compiled_collective(rank, world_size):
    import torch
    import torch.distributed as dist

    from torchtitan.distributed import hang_watch

    hang_watch.install_collective_log()

    def step(x):
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x)  # what MoE's expert-parallel dispatch issues inside a compiled block
        return y * 2

    x = torch.arange(4.0) + rank
    before = hang_watch.LOG.snapshot()["counts"]
    compiled = torch.compile(step, fullgraph=True)(x)  # dynamo traces the watch's wrapper
    traced = hang_watch.LOG.snapshot()["counts"]
    eager = step(x)
    after = hang_watch.LOG.snapshot()["counts"]
    return compiled, eager, before, traced, after


def test_a_compiled_collective_passes_through_the_watch():
    """Issue 31: dynamo traced the watch's wrapper and stopped on its lock (MoE compiled under EP died). Traced,
    the wrapper now steps aside: the compiled collective runs and is not counted (on every rank alike); an eager
    one is counted."""
    for compiled, eager, before, traced, after in run_ranks(_compiled_collective, 2):
        assert torch.equal(compiled, eager)
        assert traced == before
        assert sum(after.values()) == sum(before.values()) + 1
