"""Silent-corruption check under HSDP 2x2 (4 gloo ranks: replicate 2 x shard 2), one 110-step run: for the first
100 steps nothing is injected and the ten checks (every 10 steps) must raise no alarm (the no-false-alarm run);
then a bit of one replica's parameter shard is flipped (fault injection) at a seeded step in 101-109, and the check
at step 110 names the replicate group that disagrees (ranks 1 and 3; with two replicas no majority tells which one
flipped, so both are named and the other group, ranks 0 and 2, is not; three torchft groups name the one,
test_fault_tolerance.py). One run shows both: its first 100 steps are a fault-free 100-step run, bit for bit."""

import functools
import json
import os
import random

import pytest

from tests.distributed.trainer_runs import read_metrics, train

pytestmark = pytest.mark.distributed

HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--training.local_batch_size", "2", "--training.seq_len", "32", "--training.steps", "110",
        "--metrics.log_freq", "10", "--guard.replica_check_interval", "10"]


def with_faults(faults, rank, world_size):
    os.environ["TORCHTITAN_FAULTS"] = json.dumps(faults)


def test_flipped_bit_is_named_and_no_false_alarm(tmp_path):
    rng = random.Random(int(os.environ.get("TORCHTITAN_FAULT_SEED", "0")))
    flip = rng.randrange(101, 110)
    folder = str(tmp_path)
    # Mesh [[0, 1], [2, 3]] (replicate outer): ranks 1 and 3 hold the same shard.
    faults = [{"kind": "flip_bit", "step": flip, "rank": 3, "bit": rng.randrange(23)}]  # a mantissa bit
    with pytest.raises(RuntimeError) as err:
        train(4, HSDP, folder, setup=functools.partial(with_faults, faults))
    assert ("silent-corruption check at step 110: data-parallel replicas differ: rank(s) 1, 3 disagree on their "
            "parameters (no majority to tell the faulty one); stopping") in str(err.value), str(err.value)[-3000:]
    logged = [m["step"] for m in read_metrics(folder) if "loss" in m]
    assert logged == [1, *range(10, 111, 10)]  # trained through every earlier check, the 100 fault-free steps too
