"""A slow rank is named, with its lag, in metrics.jsonl every log step.

Rank 1 sleeps 0.3 s in every step (fault injection, after its backward): the other rank waits for it at the
gradient-norm reduction, so both have the same wall time per step; the per-rank time-to-ready must still
single out rank 1 and measure its lag as about 0.3 s.
"""

import json
import os

import pytest

from tests.distributed.trainer_runs import train

pytestmark = pytest.mark.distributed

SLEEP = 0.3


def _slow_rank(rank, world_size):
    os.environ["TORCHTITAN_FAULTS"] = json.dumps([{"kind": "sleep", "rank": 1, "seconds": SLEEP}])


def test_straggler_is_named_with_its_lag(tmp_path):
    argv = ["--training.steps", "5", "--metrics.log_freq", "2", "--parallelism.data_parallel_shard_degree", "2",
            "--training.local_batch_size", "4"]
    steps, _ = train(2, argv, str(tmp_path), setup=_slow_rank)
    windows = [m for m in steps if "straggler/slowest_rank" in m]
    assert [m["step"] for m in windows] == [2, 4, 5]  # every log step after the warm-up step
    for m in windows:
        assert m["straggler/slowest_rank"] == 1, m
        assert SLEEP * 0.8 <= m["straggler/lag_s"] <= SLEEP + 0.25, m
