"""Context-parallel layout checks: a seq_len that cannot be cut into the chunks CP (and SP) need is refused
before any rank starts, with the numbers and a seq_len that would work."""

import pytest

from torchtitan import preflight
from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims


def _dims(cp: int, tp: int) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, world_size=cp * tp)


@pytest.mark.parametrize(
    "cp,tp,seq_len,message",
    [
        (2, 1, 66, "seq_len 66 must be divisible by 4 = 2 x context_parallel_degree 2; e.g. --training.seq_len 64 or 68"),
        (4, 1, 6, "seq_len 6 must be divisible by 8 = 2 x context_parallel_degree 4; e.g. --training.seq_len 8"),
        (2, 2, 100, "seq_len 100 must be divisible by 8 = 2 x context_parallel_degree 2 x tensor_parallel_degree 2; "
                    "e.g. --training.seq_len 96 or 104"),
        (1, 2, 65, "seq_len 65 must be divisible by 2 = tensor_parallel_degree 2; e.g. --training.seq_len 64 or 66"),
    ],
)
def test_seq_len_that_does_not_split_is_named_with_a_fix(cp, tp, seq_len, message):
    with pytest.raises(LayoutError) as e:
        _dims(cp, tp).check_batch(seq_len=seq_len, global_batch_size=8, local_batch_size=8)
    assert str(e.value) == message


@pytest.mark.parametrize("cp,tp,seq_len", [(2, 1, 64), (4, 1, 8), (2, 2, 8), (2, 2, 8192)])
def test_seq_len_that_splits_is_accepted(cp, tp, seq_len):
    assert _dims(cp, tp).check_batch(seq_len=seq_len, global_batch_size=8, local_batch_size=4) == 2


def test_preflight_refuses_the_job_in_one_line(capsys):
    argv = ["--world-size", "4", "--model.flavor", "debugmodel_tiny", "--parallelism.context_parallel_degree", "2",
            "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "100"]
    assert preflight.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: seq_len 100 must be divisible by 8"), err


def test_unknown_rotate_method_is_a_config_error(capsys):
    assert preflight.main(["--parallelism.context_parallel_rotate_method", "ring"]) == 2
    assert "context_parallel_rotate_method" in capsys.readouterr().err
