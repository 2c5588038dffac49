"""Layout validation: every impossible layout gets one line with the numbers and a layout that fits."""

import pytest

from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims


def dims(world, dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1):
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world)


def test_shard_degree_minus_one_takes_the_ranks_left():
    pd = dims(8, dp_replicate=2, tp=2)
    assert (pd.dp_shard, pd.dp) == (2, 4)


def test_product_must_equal_world():
    with pytest.raises(LayoutError, match=r"multiply to 8 .* world size is 4"):
        dims(4, dp_shard=2, tp=4)


def test_world_not_divisible_names_the_fix():
    with pytest.raises(LayoutError, match=r"world size 6 is not divisible by .* = 4"):
        dims(6, tp=4)


def test_tp_must_divide_heads():
    with pytest.raises(LayoutError, match=r"tensor_parallel_degree 4 does not divide the model's n_kv_heads \(2\); degrees that fit: \[1, 2\]"):
        dims(4, tp=4).check_model({"tp": {"n_heads": 4, "n_kv_heads": 2}})


def test_seq_len_must_divide_by_cp_and_tp():
    with pytest.raises(LayoutError, match=r"seq_len 100 must be divisible by 8 .*--training.seq_len 96"):
        dims(4, cp=2, tp=2).check_batch(seq_len=100, global_batch_size=8, local_batch_size=8)


def test_global_batch_must_be_a_multiple_of_local_times_dp():
    pd = dims(4)
    assert pd.check_batch(seq_len=64, global_batch_size=16, local_batch_size=2) == 2
    with pytest.raises(LayoutError, match=r"global_batch_size 10 .* local_batch_size 2 x data-parallel degree 4 = 8; e.g. --training.global_batch_size 8"):
        pd.check_batch(seq_len=64, global_batch_size=10, local_batch_size=2)
