"""Weighted mixtures: on weight, seeded, the same under every layout, resumable under another DP degree."""

import itertools
import json
import shutil

import pytest

from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.dataloader import parse_mixture
from torchtitan.datasets.packing import GlobalBatchSlicer, SampleFeatures, ShardWindows, TextWindows
from torchtitan.datasets.pretokenize import main as pretokenize
from torchtitan.datasets.shards import open_shards
from torchtitan.datasets.sources import open_documents

SEQ = 32


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def two_shard_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    assert pretokenize(["--split", "validation", "--output", str(root / "web"), "--docs_per_part", "7"]) == 0
    shutil.copytree(root / "web", root / "code")
    return root / "web", root / "code"


def shard_sources(tok, folders):
    return [ShardWindows(open_shards(f / "validation", tok), SEQ + 1, "loop", name=f.name) for f in folders]


def mixed_sources(tok, folders):
    """One source tokenized on the fly, one from shards: both kinds of position must resume."""
    text = TextWindows(open_documents("stdlib_docs", None, "validation"), tok, SEQ + 1, "loop")
    return [text, shard_sources(tok, folders[:1])[0]]


def slicer(sources, weights=(0.7, 0.3), *, dp_rank=0, dp_degree=1, gbs=8, seed=3):
    return GlobalBatchSlicer(sources, list(weights), global_batch_size=gbs, dp_rank=dp_rank, dp_degree=dp_degree,
                             seed=seed, features=SampleFeatures(source_ids=True))


def take(ds, n):
    return [(x["source_ids"][0].item(), x["tokens"].tolist()) for x, _ in itertools.islice(iter(ds), n)]


def test_weights_hold_within_one_percent_over_10000_samples(tok, two_shard_folders):
    samples = take(slicer(shard_sources(tok, two_shard_folders), gbs=100), 10_000)
    share = sum(1 for s, _ in samples if s == 0) / len(samples)
    assert abs(share - 0.7) < 0.01, share
    # Seeded: the same seed draws the same order, another seed another one (same shares).
    again = take(slicer(shard_sources(tok, two_shard_folders), gbs=100), 1000)
    other = take(slicer(shard_sources(tok, two_shard_folders), gbs=100, seed=4), 1000)
    assert again == samples[:1000] and [s for s, _ in other] != [s for s, _ in again]


def test_a_source_continues_where_it_was_left(tok, two_shard_folders):
    """Each source's samples are its own windows in order, whatever is interleaved between them."""
    samples = take(slicer(shard_sources(tok, two_shard_folders)), 64)
    alone = take(slicer(shard_sources(tok, two_shard_folders[:1]), weights=(1.0,)), 64)
    web = [t for s, t in samples if s == 0]
    assert web == [t for _, t in alone[: len(web)]]


@pytest.mark.parametrize("dp_degree", [2, 4])
def test_every_layout_sees_the_same_global_batches(tok, two_shard_folders, dp_degree):
    gbs, steps = 8, 4
    single = take(slicer(mixed_sources(tok, two_shard_folders)), steps * gbs)
    k = gbs // dp_degree
    ranks = [take(slicer(mixed_sources(tok, two_shard_folders), dp_rank=r, dp_degree=dp_degree), steps * k)
             for r in range(dp_degree)]
    rebuilt = [x for s in range(steps) for r in range(dp_degree) for x in ranks[r][s * k:(s + 1) * k]]
    assert rebuilt == single


def resumed_under(make, old: int, new: int, gbs: int, before: int, after: int) -> list:
    """Steps [before, before + after) of the stream of `make(dp_rank, dp_degree)`, read by DP `new` from the
    state DP `old` saved after `before` steps (every rank's state must be the same)."""
    states = []
    for r in range(old):
        ds = make(r, old)
        it = iter(ds)
        for _ in range(before * gbs // old):
            next(it)
        states.append(ds.state_dict())
    assert all(s == states[0] for s in states)  # one layout-free position
    k = gbs // new
    resumed = []
    for r in range(new):
        ds = make(r, new)
        ds.load_state_dict(states[0])
        resumed.append(take(ds, after * k))
    return [x for s in range(after) for r in range(new) for x in resumed[r][s * k:(s + 1) * k]]


@pytest.mark.parametrize("old,new", [(2, 4), (4, 1)])
def test_resume_under_another_dp_degree_continues_the_sequence(tok, two_shard_folders, old, new):
    gbs, before, after = 8, 3, 3
    single = take(slicer(mixed_sources(tok, two_shard_folders)), (before + after) * gbs)
    make = lambda r, d: slicer(mixed_sources(tok, two_shard_folders), dp_rank=r, dp_degree=d)  # noqa: E731
    assert resumed_under(make, old, new, gbs, before, after) == single[before * gbs:]


def test_mixture_entries_are_checked():
    assert parse_mixture(["stdlib_docs:0.7", "/data/a:b/web:0.3"]) == [("stdlib_docs", 0.7), ("/data/a:b/web", 0.3)]
    for bad in ["stdlib_docs", "stdlib_docs:", "stdlib_docs:-1", ":0.5", "x:heavy"]:
        with pytest.raises(ValueError, match="SOURCE:WEIGHT"):
            parse_mixture([bad])


@pytest.mark.parametrize("data", ["mixture", "chat"])
def test_checkpointed_run_resumes_with_the_same_samples(tmp_path, data):
    """The trainer's checkpoint holds the loader's position (a mixture: a text source mid-document and a
    shard source; SFT chat: packed tokens with their trained mask) and, resumed, the run continues with the
    same samples: step 3 equals an uninterrupted run's (exactly)."""
    from tests.unit.checkpoint_helpers import losses, run
    from tests.unit.test_sft import RECORDS

    if data == "mixture":
        shards = tmp_path / "docs60"
        assert pretokenize(["--output", str(shards), "--max_docs", "60", "--docs_per_part", "30"]) == 0
        # A schedule too: resumed after step 2, inside the ramp of the phase from (0-based) step 1.
        argv = ["--training.datasets", f"stdlib_docs:0.6,{shards}:0.4",
                "--training.mixture_phases", "step=1 stdlib_docs:0.1 docs60:0.9 ramp=2"]
    else:
        chat = tmp_path / "chat.jsonl"
        chat.write_text("".join(json.dumps(r) + "\n" for r in RECORDS * 5))
        argv = ["--training.dataset", "chat", "--training.dataset_path", str(chat)]
    argv += ["--training.document_masking", "--debug.seed", "5", "--checkpoint.interval", "2"]
    assert run(tmp_path / "full", *argv, "--training.steps", "4") == 0
    assert run(tmp_path / "resumed", *argv, "--training.steps", "2", "--checkpoint.enable") == 0
    assert run(tmp_path / "resumed", *argv, "--training.steps", "4", "--checkpoint.enable") == 0
    # Step 3's loss is the weights after step 2 (same LR so far) on step 3's samples. Step 4 is not compared:
    # extending a finished 2-step run re-fits the LR schedule to 4 steps, so its step-3 update differs.
    assert losses(tmp_path / "resumed")[-2] == losses(tmp_path / "full")[2]
    if data == "mixture":  # tokens_seen/<source>: every sample's seq_len input tokens, counted by its source
        with open(tmp_path / "full" / "metrics.jsonl") as f:
            seen = [(m["tokens_seen/stdlib_docs"], m["tokens_seen/docs60"]) for m in map(json.loads, f) if "loss" in m]
        assert [a + b for a, b in seen] == [step * 4 * 32 for step in range(1, 5)]
        assert seen[-1][1] - seen[1][1] > seen[-1][0] - seen[1][0]  # the later phase favours docs60
