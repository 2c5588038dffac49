"""Silent-corruption check under HSDP 2x2 (4 gloo ranks: replicate 2 x shard 2), one 100-step run: a bit of one
replica's parameter shard is flipped (fault injection) at a seeded step in the last ten; the checks every 10
steps before it raise no alarm (no false alarm over 90 steps of fault-free training), and the first check after
it names the rank and its replica partner."""

import functools
import json
import os
import random

import pytest

from tests.distributed.trainer_runs import read_metrics, train

pytestmark = pytest.mark.distributed

HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--training.local_batch_size", "2", "--training.seq_len", "32", "--training.steps", "100",
        "--metrics.log_freq", "10", "--guard.replica_check_interval", "10"]


def with_faults(faults, rank, world_size):
    os.environ["TORCHTITAN_FAULTS"] = json.dumps(faults)


def test_flipped_bit_is_named_and_no_false_alarm(tmp_path):
    rng = random.Random(int(os.environ.get("TORCHTITAN_FAULT_SEED", "0")))
    flip = rng.randrange(91, 100)
    folder = str(tmp_path)
    # Mesh [[0, 1], [2, 3]] (replicate outer): ranks 1 and 3 hold the same shard.
    faults = [{"kind": "flip_bit", "step": flip, "rank": 3, "bit": rng.randrange(23)}]  # a mantissa bit
    with pytest.raises(RuntimeError) as err:
        train(4, HSDP, folder, setup=functools.partial(with_faults, faults))
    assert ("silent-corruption check at step 100: data-parallel replicas differ: rank(s) 3 disagree with rank(s) 1 "
            "on their parameters; stopping") in str(err.value), str(err.value)[-3000:]
    logged = [m["step"] for m in read_metrics(folder) if "loss" in m]
    assert logged == [1, *range(10, 101, 10)]  # trained through every earlier check
