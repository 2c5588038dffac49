"""Sliding windows and sinks in the shared attention kernel, exact against an explicit softmax.

The reference is written differently from the kernel: the full [S, S] score matrix, a boolean mask built from
positions, the sink appended as one more column of logits (transformers' GPT-OSS eager path does the same)
and dropped after the softmax. Forward and every gradient (q, k, v, sinks) must agree within 1e-5 (fp32), on
shapes where the query blocks, the window and the documents cut each other unevenly, with GQA.
"""

import pytest
import torch

from tests.tolerances import attention_tol
from torchtitan.models.common import attention
from torchtitan.models.common.attention import ScaledDotProductAttention, blockwise_attention


def reference(q, k, v, document_ids=None, window=None, sinks=None):
    b, hq, s, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) / d**0.5
    i = torch.arange(s).view(-1, 1)
    j = torch.arange(s).view(1, -1)
    visible = (j <= i) if window is None else (j <= i) & (i - j < window)
    visible = visible.expand(b, s, s)
    if document_ids is not None:
        visible = visible & (document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2))
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, hq, s, 1)], dim=-1)
    probs = scores.softmax(-1)[..., :s]
    return probs @ v


def _inputs(seed=0, b=2, hq=4, hkv=2, s=50, d=8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=g) * 2
    ids = torch.zeros(b, s, dtype=torch.long)
    ids[0, 13:], ids[0, 31:] = 1, 2
    ids[1, 40:] = 1
    return q, k, v, sinks, ids


CASES = {
    "window": dict(window=7),
    "sinks": dict(sinks=True),
    "window_sinks": dict(window=5, sinks=True),
    "window_sinks_documents": dict(window=9, sinks=True, documents=True),
    "sinks_documents": dict(sinks=True, documents=True),
    "window_1": dict(window=1, sinks=True),
    "window_wider_than_sequence": dict(window=80),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("block", [16, 256])
def test_forward_and_gradients_match_explicit_softmax(case, block):
    c = CASES[case]
    q, k, v, sinks, ids = _inputs()
    sinks = sinks if c.get("sinks") else None
    ids = ids if c.get("documents") else None
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    for t in leaves:
        t.requires_grad_(True)
    out = blockwise_attention(q, k, v, ids, c.get("window"), sinks, block=block)
    ref = reference(q, k, v, ids, c.get("window"), sinks)
    s, d = q.shape[2], q.shape[3]
    # Blocks of 16 or 256 against the full score matrix (float32): Measured: uses 0.071 of it (AVX-512), 0.071 (AVX2
    # caps).
    torch.testing.assert_close(out, ref, **attention_tol(ref, s, d))
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, g)
    want = torch.autograd.grad(ref, leaves, g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **attention_tol(b, s, d, gradient=True))


def test_the_kernel_module_reads_its_kind():
    q, k, v, sinks, _ = _inputs(seed=1)
    ref = reference(q, k, v, window=6, sinks=sinks)
    # as above: Measured: uses 0.015 of it (AVX-512), 0.015 (AVX2 caps).
    tol = attention_tol(ref, q.shape[2], q.shape[3])
    torch.testing.assert_close(ScaledDotProductAttention(window=6)(q, k, v, sinks=sinks), ref, **tol)
    # Negative controls: without the sink, or without the window, the answer differs far beyond the tolerance.
    for wrong in (ScaledDotProductAttention(window=6)(q, k, v), ScaledDotProductAttention()(q, k, v, sinks=sinks)):
        assert (wrong - ref).abs().max() > 100 * (tol["atol"] + tol["rtol"] * ref.abs().max())


def test_key_spans_stop_at_the_window():
    """No [S, S] work: with a window of 16 and blocks of 32, every query block reads at most 32 + 15 keys."""
    spans = attention._spans(256, 32, 16, None)
    assert [(q0, k0) for q0, _, k0 in spans][:3] == [(0, 0), (32, 17), (64, 49)]
    assert max(q1 - k0 for _, q1, k0 in spans) == 47


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_a_window_below_one_is_one_line(window):
    with pytest.raises(ValueError, match="must be an integer >= 1") as e:
        ScaledDotProductAttention(window=window)
    assert "\n" not in str(e.value)
