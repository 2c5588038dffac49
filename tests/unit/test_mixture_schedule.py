"""Mixture schedules and failing sources at the sampler level (no model): each phase on weight, resumable
mid-phase under another DP degree, extensible with a new phase; a source that fails and recovers reads the
same samples; bad schedules are refused in one line by the pre-flight check."""

import shutil

import pytest

from tests.unit.test_mixture import SEQ, resumed_under, take, tok  # noqa: F401 (tok is a fixture)
from torchtitan import preflight
from torchtitan.datasets import packing
from torchtitan.datasets.packing import (
    GlobalBatchSlicer, MixturePlan, ReadRetry, SampleFeatures, ShardWindows, TextWindows,
)
from torchtitan.datasets.pretokenize import main as pretokenize
from torchtitan.datasets.schedule import MixtureSchedule, Phase
from torchtitan.datasets.shards import open_shards
from torchtitan.datasets.sources import DataSourceError, DocumentSource, open_documents
from torchtitan.protocols.train_spec import config_manager

NAMES = ("web", "code", "curated")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """web and curated: the validation documents; code: 20 train documents (other tokens), in its validation/."""
    root = tmp_path_factory.mktemp("sched")
    assert pretokenize(["--split", "validation", "--output", str(root / "web"), "--docs_per_part", "7"]) == 0
    shutil.copytree(root / "web", root / "curated")
    assert pretokenize(["--split", "train", "--output", str(root / "code"), "--max_docs", "20"]) == 0
    (root / "code" / "train").rename(root / "code" / "validation")
    return [root / n for n in NAMES]


def schedule(folders, phases: list[str], extra: list[str] = (), base=(0.5, 0.3, 0.2)) -> MixtureSchedule:
    """The schedule a user's options give: base weights (web, code, curated), then `phases`."""
    from torchtitan.datasets.dataloader import parse_mixture
    from torchtitan.datasets.schedule import mixture_schedule

    datasets = [f"{f}:{w}" for f, w in zip(folders, base)]
    cfg = config_manager().parse_args(["--training.datasets", ",".join(datasets),
                                       "--training.mixture_phases", ",".join(phases), *extra])
    return mixture_schedule(cfg, parse_mixture(cfg.training.datasets))


def shards(tok, folders):
    return [ShardWindows(open_shards(f / "validation", tok), SEQ + 1, "loop", name=f.name) for f in folders]


def mixed(tok, folders):
    """A raw-text source (its position is mid-document at a step boundary) and two shard sources."""
    text = TextWindows(open_documents("stdlib_docs", None, "validation"), tok, SEQ + 1, "loop", name="web")
    return [text] + shards(tok, folders[1:])


def slicer(sources, weights, *, gbs, dp_rank=0, dp_degree=1, seed=3):
    return GlobalBatchSlicer(sources, weights, global_batch_size=gbs, dp_rank=dp_rank, dp_degree=dp_degree,
                             seed=seed, features=SampleFeatures(source_ids=True))


def assert_on_weight(choices: list[int], weights, tol=0.01):
    """Each source's share of `choices` (source indices) is its weight, within `tol`."""
    got = [choices.count(c) / len(choices) for c in range(len(NAMES))]
    assert all(abs(g - w) < tol for g, w in zip(got, weights)), (got, weights)


def test_two_phases_hit_their_ratios_within_one_percent(tok, folders):
    gbs = 100  # phase 1 from step 100 = sample 10,000
    sched = schedule(folders, ["step=100 web:0.2 code:0.3 curated:0.5"])
    choices = MixturePlan(sched, seed=3, global_batch_size=gbs).choices(0, 20_000).tolist()
    assert_on_weight(choices[:10_000], (0.5, 0.3, 0.2))
    assert_on_weight(choices[10_000:], (0.2, 0.3, 0.5))
    # Without phases the draws are the constant mixture's, sample for sample (old runs resume unchanged).
    assert MixturePlan([0.5, 0.3, 0.2], seed=3).choices(0, 10_000).tolist() == choices[:10_000]
    # The loader reads those draws (over the phase boundary: step 10 of gbs 10 here).
    plan = MixturePlan(schedule(folders, ["step=10 web:0.2 code:0.3 curated:0.5"]), seed=3, global_batch_size=10)
    read = take(slicer(shards(tok, folders), plan.schedule, gbs=10), 300)
    assert [s for s, _ in read] == plan.choices(0, 300).tolist()


def test_a_ramp_moves_the_weights_linearly(folders):
    sched = schedule(folders, ["step=10 web:0.2 code:0.3 curated:0.5 ramp=20"])
    assert sched.weights_at(9) == pytest.approx((0.5, 0.3, 0.2))
    assert sched.weights_at(19) == pytest.approx((0.35, 0.3, 0.35))  # halfway: 10 of 20 ramp steps trained
    assert sched.weights_at(29) == pytest.approx((0.2, 0.3, 0.5)) == sched.weights_at(10_000)
    # gbs 1000: one block per step, each on that step's weights (exactly, up to rounding to 1/1000).
    choices = MixturePlan(sched, seed=3, global_batch_size=1000).choices(0, 30_000).tolist()
    for step in (9, 14, 19, 24, 29):
        assert_on_weight(choices[step * 1000:(step + 1) * 1000], sched.weights_at(step), tol=0.0011)


@pytest.mark.parametrize("old,new", [(2, 4)])
def test_resume_mid_phase_under_another_dp_degree_continues_bitwise(tok, folders, old, new):
    gbs, before, after = 8, 5, 4  # stops at step 5: inside phase 1's ramp (steps 3..6)
    sched = schedule(folders, ["step=3 web:0.1 code:0.1 curated:0.8 ramp=4", "step=7 web:0.6 code:0.4"])
    single = take(slicer(mixed(tok, folders), sched, gbs=gbs), (before + after) * gbs)
    assert {s for s, _ in single[7 * gbs:]} <= {0, 1}  # phase 2 reads no curated sample
    make = lambda r, d: slicer(mixed(tok, folders), sched, gbs=gbs, dp_rank=r, dp_degree=d)  # noqa: E731
    assert resumed_under(make, old, new, gbs, before, after) == single[before * gbs:]


@pytest.mark.parametrize("added", [False, True], ids=["reweighted", "new-source"])
def test_extending_a_finished_run_with_a_new_phase(tok, folders, added):
    """A run of 105 steps (gbs 10: the block of phase 1 holding samples [500, 1500) is cut at 1,050) extended with
    a new phase from step 105: the samples of the first 105 steps are those of the original schedule, the resumed
    run continues exactly as the extended schedule from scratch, and the new phase is on weight. new-source: the
    original run read web and code only; the extension adds curated (weight 0 until its phase)."""
    gbs, done, more = 10, 105, 100
    first_phase = "step=50 web:0.2 code:0.6" + ("" if added else " curated:0.2")
    n = 2 if added else 3
    original = schedule(folders[:n], [first_phase], base=(0.5, 0.3, 0.2)[:n])
    extended = schedule(folders, [first_phase, "step=105 web:0.1 code:0.1 curated:0.8"],
                        base=(0.5, 0.3, 0.0 if added else 0.2))
    ds = slicer(shards(tok, folders[:n]), original, gbs=gbs)
    first = take(ds, done * gbs)
    state = ds.state_dict()
    fresh = take(slicer(shards(tok, folders), extended, gbs=gbs), (done + more) * gbs)
    assert fresh[: done * gbs] == first
    resumed = slicer(shards(tok, folders), extended, gbs=gbs)
    resumed.load_state_dict(state)
    assert take(resumed, more * gbs) == fresh[done * gbs:]
    new_phase = MixturePlan(extended, seed=3, global_batch_size=gbs).choices(done * gbs, 10_000).tolist()
    assert_on_weight(new_phase, (0.1, 0.1, 0.8))


class FlakySource(DocumentSource):
    """The shipped validation documents; the reads numbered in `fail_on` (0-based, over every document
    read) raise `error` (by default OSError, as a dropped stream would)."""

    resumable = True

    def __init__(self, fail_on=(), error: Exception = OSError("connection reset by peer")):
        self.inner = open_documents("stdlib_docs", None, "validation")
        self.name, self.fail_on, self.reads, self.opened_at = "flaky", set(fail_on), 0, []
        self.error = error

    def iter_from(self, doc_index):
        self.opened_at.append(doc_index)
        for doc in self.inner.iter_from(doc_index):
            self.reads += 1
            if self.reads - 1 in self.fail_on:
                raise self.error
            yield doc


def flaky_run(tok, source, retries, n=240):
    """n samples of a 50/50 mixture of `source` and the same documents read without faults (documents average
    ~1,400 tokens: the first 120 windows of 33 read 3 or more of them)."""
    text = TextWindows(source, tok, SEQ + 1, "loop", retry=ReadRetry(retries, 0.25))
    return take(slicer([text] + [TextWindows(open_documents("stdlib_docs", None, "validation"), tok, SEQ + 1,
                                             "loop", name="plain")], [0.5, 0.5], gbs=4), n)


def test_a_source_failing_twice_then_recovering_reads_the_same_samples(tok, monkeypatch):
    waits = []
    monkeypatch.setattr(packing.time, "sleep", waits.append)
    reference = flaky_run(tok, FlakySource(), retries=2)
    flaky = FlakySource(fail_on={2, 3})  # document 2 fails twice: read 2, then the reopened stream's first read
    assert flaky_run(tok, flaky, retries=2) == reference
    assert flaky.opened_at == [0, 2, 2] and waits == [0.25, 0.5]  # reopened at the same document, backoff x2

    waits.clear()
    broken = FlakySource(fail_on=range(2, 10**6))
    with pytest.raises(DataSourceError, match=r"^data source flaky failed 3 times in a row reading document 2 "
                                              r"\(OSError: connection reset by peer\)"):
        flaky_run(tok, broken, retries=2)
    assert waits == [0.25, 0.5]
    # A document that does not parse is not retried: it would fail again.
    waits.clear()
    garbled = FlakySource(fail_on={2}, error=ValueError("line 3: not valid JSON"))
    with pytest.raises(ValueError, match="not valid JSON"):
        flaky_run(tok, garbled, retries=2)
    assert waits == [] and garbled.opened_at == [0]


TINY = ["--model.flavor", "debugmodel_tiny4", "--training.seq_len", "32", "--training.local_batch_size", "4",
        "--training.steps", "100", "--training.datasets", "stdlib_docs:0.5,c4:0.5"]
BAD = {  # options -> what the one line says
    "weights that do not parse": (["--training.mixture_phases", "step=10 stdlib_docs:heavy"],
                                  "'stdlib_docs:heavy' must be SOURCE:WEIGHT with a weight >= 0"),
    "a step that does not parse": (["--training.mixture_phases", "step=ten c4:1"], "'step=ten' must be step=N"),
    "a phase before the previous one": (["--training.mixture_phases", "step=20 c4:1,step=10 stdlib_docs:1"],
                                        "a phase starting at step 10 comes after one starting at step 20"),
    "a source not in the mixture": (["--training.mixture_phases", "step=10 fineweb:1"],
                                    "names source 'fineweb', which is not in --training.datasets"),
    "anneal before the last phase": (["--training.mixture_phases", "step=95 c4:1", "--training.mixture_anneal",
                                      "stdlib_docs:1", "--lr_scheduler.decay_ratio", "0.1",
                                      "--lr_scheduler.warmup_steps", "10"],
                                     "a phase starting at step 90 comes after one starting at step 95"),
    "anneal without a decay phase": (["--training.mixture_anneal", "stdlib_docs:1"], "set decay_ratio"),
    "a negative retry budget": (["--training.source_retries", "-1"], "--training.source_retries must be 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_schedules_are_refused_in_one_line_before_any_rank_starts(case, capsys):
    argv, says = BAD[case]
    assert preflight.main(["--world-size", "2"] + TINY + argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


def test_the_anneal_preset_starts_with_the_lr_decay(folders):
    sched = schedule(folders, ["step=50 web:0.4 code:0.6"], ["--training.steps", "100", "--training.mixture_anneal",
                                                            "curated:0.8,web:0.2", "--lr_scheduler.decay_ratio",
                                                            "0.2", "--lr_scheduler.warmup_steps", "10"])
    assert sched.phases[-1] == Phase(80, (0.2, 0.0, 0.8))
    assert sched.weights_at(79) == pytest.approx((0.4, 0.6, 0.0))
