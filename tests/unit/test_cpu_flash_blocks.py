"""Windows, sinks and documents through SDPA's CPU flash kernel (models/common/cpu_flash_blocks.py) equal the
exact plain-torch span loop (blockwise_attention, fp32 inside), outputs and every gradient, and the shared
kernel picks the flash path on CPU in eager mode for each of them (plain causal attention keeps one SDPA call)."""

import pytest
import torch

from tests.tolerances import attention_tol
from torchtitan.models.common import attention


@pytest.mark.parametrize("window, sinks, docs", [(None, True, False), (40, False, False), (40, True, True),
                                                  (None, False, True), (40, False, True)])
def test_equals_the_plain_torch_span_loop_in_float32(window, sinks, docs):
    g = torch.Generator().manual_seed(0)
    batch, hq, hkv, seq, dim = 2, 4, 2, 150, 16  # 3 query blocks of 64, the last one partial
    q, k, v = (torch.randn(batch, h, seq, dim, generator=g) for h in (hq, hkv, hkv))
    dout = torch.randn(batch, hq, seq, dim, generator=g)
    sink = torch.randn(hq, generator=g) if sinks else None
    doc_ids = torch.sort(torch.randint(0, 4, (batch, seq), generator=g), dim=1).values if docs else None

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sinks else [])
        out = fn(*leaves[:3], doc_ids, window, leaves[3] if sinks else None, block=64)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    ref, new = run(attention.blockwise_attention), run(attention.cpu_flash_block_attention)
    # SDPA's flash kernel (its own blocks and online softmax) against the span loop, float32: Measured: uses 0.018 of it
    # (AVX-512), 0.018 (AVX2 caps).
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), ref, new):
        torch.testing.assert_close(b, a, **attention_tol(a, seq, dim, gradient=name != "out"), msg=name)


def test_the_shared_kernel_picks_it_on_cpu_eager(monkeypatch):
    calls = []
    real = attention.cpu_flash_block_attention
    monkeypatch.setattr(attention, "cpu_flash_block_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v = torch.randn(1, 2, 64, 16), torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
    out = attention.ScaledDotProductAttention(window=8)(q, k, v)
    assert calls == [1]
    ref = attention.blockwise_attention(q, k, v, window=8)
    # as above: Measured: uses 0.029 of it (AVX-512), 0.029 (AVX2 caps).
    torch.testing.assert_close(out, ref, **attention_tol(ref, 64, 16))
    ids = torch.tensor([[0] * 20 + [1] * 44])
    out = attention.ScaledDotProductAttention()(q, k, v, ids)  # documents alone
    assert calls == [1, 1]
    ref = attention.blockwise_attention(q, k, v, ids)
    torch.testing.assert_close(out, ref, **attention_tol(ref, 64, 16))
    attention.ScaledDotProductAttention()(q, k, v)  # plain causal keeps SDPA
    assert calls == [1, 1]
