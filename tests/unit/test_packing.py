"""The global token stream: layout-independent batches and exact, reshardable resume."""

import itertools

import pytest
import torch

from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.packing import GlobalBatchSlicer, TextWindows
from torchtitan.datasets.sources import DocumentSource

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (1 + i % 7) for i in range(60)]


class ListSource(DocumentSource):
    name, resumable = "list", True

    def __init__(self, docs):
        self.docs = docs

    def iter_from(self, doc_index):
        return iter(self.docs[doc_index:])


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def make(tok, *, dp_rank=0, dp_degree=1, gbs=8, seq_len=16, infinite=True):
    source = TextWindows(ListSource(DOCS), tok, seq_len + 1, "loop" if infinite else "end")
    return GlobalBatchSlicer([source], [1.0], global_batch_size=gbs, dp_rank=dp_rank, dp_degree=dp_degree)


def take(ds, n):
    return [tuple(t.tolist() for t in s) for s in itertools.islice(iter(ds), n)]


def test_windows_are_the_tokenized_concatenation(tok):
    stream = TextWindows(ListSource(DOCS[:5]), tok, 17, "end")
    windows = [w.tokens.tolist() for w in iter(stream.next_window, None)]
    expected = [t for d in DOCS[:5] for t in tok.encode(d, bos=True, eos=True)]
    flat = [t for w in windows for t in w]
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 17
    assert windows[0][0] == tok.bos_id


def test_inputs_and_labels_shift_by_one(tok):
    inp, lab = next(iter(make(tok)))
    assert inp.shape == lab.shape == (16,)
    assert torch.equal(inp[1:], lab[:-1])


@pytest.mark.parametrize("dp_degree", [2, 4])
def test_global_batch_is_layout_independent(tok, dp_degree):
    steps, gbs = 3, 8
    single = take(make(tok, gbs=gbs), steps * gbs)
    per_rank = [take(make(tok, dp_rank=r, dp_degree=dp_degree, gbs=gbs), steps * gbs // dp_degree)
                for r in range(dp_degree)]
    slice_size = gbs // dp_degree
    for s in range(steps):
        rebuilt = [x for r in range(dp_degree) for x in per_rank[r][s * slice_size:(s + 1) * slice_size]]
        assert rebuilt == single[s * gbs:(s + 1) * gbs]


def test_resume_mid_batch_is_exact(tok):
    ref = take(make(tok), 30)
    ds = make(tok)
    it = iter(ds)
    first = [tuple(t.tolist() for t in next(it)) for _ in range(13)]  # 13 = one step and 5 of the next
    state = ds.state_dict()
    fresh = make(tok)
    fresh.load_state_dict(state)
    assert first + take(fresh, 17) == ref


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (4, 1)])
def test_resume_under_another_dp_degree_at_a_step_boundary(tok, old, new):
    gbs, steps_before, steps_after = 8, 2, 2
    single = take(make(tok, gbs=gbs), (steps_before + steps_after) * gbs)
    # Train `steps_before` steps under `old` ranks; all ranks report the same, layout-free state.
    states = []
    for r in range(old):
        ds = make(tok, dp_rank=r, dp_degree=old, gbs=gbs)
        it = iter(ds)
        for _ in range(steps_before * gbs // old):
            next(it)
        states.append(ds.state_dict())
    assert all(s == states[0] for s in states)
    resumed = []
    for r in range(new):
        ds = make(tok, dp_rank=r, dp_degree=new, gbs=gbs)
        ds.load_state_dict(states[0])
        resumed.append(take(ds, steps_after * gbs // new))
    k = gbs // new
    for s in range(steps_after):
        rebuilt = [x for r in range(new) for x in resumed[r][s * k:(s + 1) * k]]
        off = (steps_before + s) * gbs
        assert rebuilt == single[off:off + gbs]


def test_finite_stream_stops_and_infinite_wraps(tok):
    finite = take(make(tok, infinite=False, seq_len=64), 10_000)
    assert 0 < len(finite) < 10_000 and len(finite) % 8 == 0
    infinite = take(make(tok, infinite=True, seq_len=64), len(finite) + 16)
    assert infinite[: len(finite)] == finite and len(infinite) == len(finite) + 16
