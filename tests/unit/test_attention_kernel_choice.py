"""The CPU attention kernel choice (models/common/attention.py `cpu_reads_kv_in_place`): grouped-query
attention read in place (SDPA's enable_gqa) gives what repeating the kv heads gave, forward and backward, for
plain causal attention and for document masking; a wrong head grouping is caught (the negative control)."""

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common import attention
from torchtitan.models.common.attention import ScaledDotProductAttention

# float32 on CPU: the same kernel on the same values, so only the order of a few sums may differ.
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seq: int = 96, heads: int = 4, kv_heads: int = 2, dim: int = 16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, seq, dim, generator=g, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, dim, generator=g, requires_grad=True)
    dout = torch.randn(2, heads, seq, dim, generator=g)
    # two sequences packed with documents of different lengths
    doc_ids = torch.tensor([[0] * 30 + [1] * 50 + [2] * 16, [0] * 70 + [1] * 26])
    return q, k, v, dout, doc_ids


def _run(fn, q, k, v, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def _reference(q, k, v, doc_ids, grouping):
    """Explicit softmax over the visible keys, kv heads expanded by `grouping`."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = grouping(k, n_rep), grouping(v, n_rep)
    seq = q.shape[2]
    pos = torch.arange(seq)
    ids = doc_ids if doc_ids is not None else torch.zeros(q.shape[0], seq, dtype=torch.long)
    visible = attention.document_causal_mask(ids, ids, pos, pos).unsqueeze(1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v


def _interleaved(t, n):  # query head h reads kv head h // n (what GQA means)
    return t.repeat_interleave(n, dim=1)


def _tiled(t, n):  # query head h reads kv head h % n_kv: the wrong grouping
    return t.repeat(1, n, 1, 1)


@pytest.mark.parametrize("case", ["causal", "documents"])
def test_cpu_choice_matches_the_explicit_softmax_and_the_repeat_path(case):
    q, k, v, dout, doc_ids = _inputs()
    ids = doc_ids if case == "documents" else None
    assert attention.cpu_reads_kv_in_place(q)  # the choice this test is about is the one CPU runs make
    chosen = _run(lambda q, k, v: ScaledDotProductAttention()(q, k, v, ids), q, k, v, dout)
    reference = _run(lambda q, k, v: _reference(q, k, v, ids, _interleaved), q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), chosen, reference):
        torch.testing.assert_close(a, b, **TOL, msg=name)

    # The path before the choice (kv heads repeated, then SDPA) gives the same numbers.
    def repeated(q, k, v):
        n = q.shape[1] // k.shape[1]
        if ids is None:
            return F.scaled_dot_product_attention(q, _interleaved(k, n), _interleaved(v, n), is_causal=True)
        return attention._blockwise_document_attention(q, _interleaved(k, n), _interleaved(v, n), ids)

    for name, a, b in zip(("out", "dq", "dk", "dv"), chosen, _run(repeated, q, k, v, dout)):
        torch.testing.assert_close(a, b, **TOL, msg=name)

    # Negative control: the reference with the wrong head grouping differs, so the checks above can fail.
    wrong = _run(lambda q, k, v: _reference(q, k, v, ids, _tiled), q, k, v, dout)
    assert (chosen[0] - wrong[0]).abs().max() > 1e-2


def test_compiled_graphs_keep_the_explicit_repeat(monkeypatch):
    q = torch.zeros(1, 4, 8, 16)
    assert attention.cpu_reads_kv_in_place(q)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not attention.cpu_reads_kv_in_place(q)
    assert not attention.cpu_reads_kv_in_place(q.to("meta"))
