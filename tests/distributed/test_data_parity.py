"""The data path changes nothing it should not: training from pre-tokenized shards equals training from
raw text step for step, and a mixture's per-source losses, in training and in validation, are the same
under DP 2 and PP 2 as in one process (the token-loss sums and counts of every source are summed over ranks
before dividing; under PP the last stage computes them inside the schedule)."""

import gzip
import json
from pathlib import Path

import pytest
import torch

import torchtitan

from tests.distributed.test_parity_2d import LOSS_RTOL
from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, read_metrics, train
from torchtitan.datasets.pretokenize import main as pretokenize

pytestmark = pytest.mark.distributed

SHORT = ["--training.steps", "4"]
STDLIB_TRAIN = Path(torchtitan.__file__).parent / "assets" / "stdlib_docs" / "train.jsonl.gz"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "stdlib_shards"
    assert pretokenize(["--output", str(out), "--workers", "2", "--docs_per_part", "100"]) == 0
    assert pretokenize(["--output", str(out), "--split", "validation"]) == 0
    return out


@pytest.fixture(scope="module")
def other_shards(tmp_path_factory):
    """A second source that is not the first one in another format: the shipped docstrings upper-cased (other
    tokens, so another loss), pre-tokenized; its validation split is the local hold-out (every 100th document)."""
    folder = tmp_path_factory.mktemp("upper")
    corpus = folder / "upper.jsonl"
    with gzip.open(STDLIB_TRAIN, "rt") as src, open(corpus, "w") as dst:
        for line in src:
            dst.write(json.dumps({"text": json.loads(line)["text"].upper()}) + "\n")
    out = folder / "upper_shards"
    for split in ("train", "validation"):
        assert pretokenize(["--dataset", "local", "--dataset_path", str(corpus), "--output", str(out),
                            "--split", split]) == 0
    return out


def test_run_from_shards_equals_run_from_raw_text(shards, tmp_path):
    argv = SHORT + ["--training.local_batch_size", "4"] + DOCUMENT_MASKING
    text, _ = train(1, argv, str(tmp_path / "text"))
    sharded, _ = train(1, argv + ["--training.dataset", str(shards)], str(tmp_path / "shards"))
    for a, b in zip(curves(text), curves(sharded)):
        assert len(a) == 4 and torch.equal(a, b)  # identical samples, so identical numbers


# Validation after the last step over 8 sequences per evaluation whatever the layout (4 per rank under DP 2).
MIXTURE = ["--training.datasets", "stdlib_docs:0.7,{shards}:0.3", "--validation.enable", "--validation.freq", "4",
           "--validation.steps", "2"] + SHORT
SOURCE_KEYS = ["loss", "loss/stdlib_docs", "loss/upper_shards"]
VALIDATION_KEYS = [f"validation/{k}" for k in SOURCE_KEYS]


def per_source(folder: str, steps: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(training [steps, SOURCE_KEYS], validation [VALIDATION_KEYS]) of a run."""
    validation = [m for m in read_metrics(folder) if "validation/loss" in m]
    assert len(validation) == 1 and all(k in validation[0] for k in VALIDATION_KEYS), validation
    return (torch.tensor([[m[k] for k in SOURCE_KEYS] for m in steps], dtype=torch.float64),
            torch.tensor([validation[0][k] for k in VALIDATION_KEYS], dtype=torch.float64))


@pytest.fixture(scope="module")
def single_process_mixture(other_shards, tmp_path_factory):
    argv = [a.format(shards=other_shards) for a in MIXTURE] + ["--training.local_batch_size", "4",
                                                         "--validation.local_batch_size", "4"]
    folder = str(tmp_path_factory.mktemp("single"))
    steps, _ = train(1, argv, folder)
    assert all(k in m for m in steps for k in SOURCE_KEYS)
    ref, val = per_source(folder, steps)
    # Two corpora, so the per-source keys cannot hold one number twice unnoticed: a code that logged one
    # source's loss under both names would fail here. At initialisation the model predicts near-uniformly, so
    # the first steps' losses are close for any text; after 4 steps the two sources are >0.5 nat apart.
    assert abs(ref[-1, 1] - ref[-1, 2]) > 0.1, ref
    assert abs(val[1] - val[2]) > 0.1, val
    return ref, val


# DP 2: each rank holds half the sources' tokens. PP 2: the last stage computes the loss of 4 microbatches
# (2 per schedule step, 2 accumulation steps) and rank 0, which logs, holds the first stage only.
@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2",
         "--validation.local_batch_size", "2"],
        ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4",
         "--parallelism.pipeline_parallel_microbatch_size", "2", "--validation.local_batch_size", "4"],
    ],
    ids=["dp2", "pp2"],
)
def test_per_source_loss_matches_one_process(single_process_mixture, other_shards, layout, tmp_path):
    argv = [a.format(shards=other_shards) for a in MIXTURE] + layout
    steps, _ = train(2, argv, str(tmp_path))
    got, val = per_source(str(tmp_path), steps)
    ref, ref_val = single_process_mixture
    torch.testing.assert_close(got, ref, rtol=LOSS_RTOL, atol=0)
    torch.testing.assert_close(val, ref_val, rtol=LOSS_RTOL, atol=0)
