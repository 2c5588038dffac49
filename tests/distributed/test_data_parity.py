"""The data path changes nothing it should not: training from pre-tokenized shards equals training from
raw text step for step, and a mixture's per-source losses are the same under DP 2 as in one process (the
token-loss sums and counts of every source are summed over ranks before dividing)."""

import pytest
import torch

from tests.distributed.test_parity_2d import LOSS_RTOL
from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, train
from torchtitan.datasets.pretokenize import main as pretokenize

pytestmark = pytest.mark.distributed

SHORT = ["--training.steps", "4"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "stdlib_shards"
    assert pretokenize(["--output", str(out), "--workers", "2", "--docs_per_part", "100"]) == 0
    return out


def test_run_from_shards_equals_run_from_raw_text(shards, tmp_path):
    argv = SHORT + ["--training.local_batch_size", "4"] + DOCUMENT_MASKING
    text, _ = train(1, argv, str(tmp_path / "text"))
    sharded, _ = train(1, argv + ["--training.dataset", str(shards)], str(tmp_path / "shards"))
    for a, b in zip(curves(text), curves(sharded)):
        assert len(a) == 4 and torch.equal(a, b)  # identical samples, so identical numbers


def test_per_source_loss_is_summed_over_data_parallel_ranks(shards, tmp_path):
    mixture = ["--training.datasets", f"stdlib_docs:0.7,{shards}:0.3"] + SHORT
    single, _ = train(1, mixture + ["--training.local_batch_size", "4"], str(tmp_path / "single"))
    dp2, _ = train(2, mixture + ["--parallelism.data_parallel_shard_degree", "2",
                                 "--training.local_batch_size", "2"], str(tmp_path / "dp2"))
    keys = ["loss", "loss/stdlib_docs", "loss/stdlib_shards"]
    assert all(k in m for m in single for k in keys)
    got = torch.tensor([[m[k] for k in keys] for m in dp2], dtype=torch.float64)
    ref = torch.tensor([[m[k] for k in keys] for m in single], dtype=torch.float64)
    torch.testing.assert_close(got, ref, rtol=LOSS_RTOL, atol=0)
    assert not torch.allclose(ref[:, 1], ref[:, 2])  # the two sources' losses are told apart
