"""Document masking: attention stays inside each document of a packed window, exactly.

Exactness is the point: a token of document B must get bit-identical logits whatever document A holds
(difference exactly 0, not "small"), and with masking off the same check must show A leaking into B.
"""

import pytest
import torch
import torch.nn.functional as F

import torchtitan.models.common.attention as attention
from tests.tolerances import attention_tol, contraction_width, logits_tol
from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.protocols.documents import document_ids_from_bos, positions_in_documents
from torchtitan.datasets.packing import SampleFeatures, Window, make_sample
from torchtitan.models.llama3.args import TransformerModelArgs
from torchtitan.models.llama3.model import Transformer

TINY = TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=16,
                            max_seq_len=64)
SEQ = 48
DOC_A_LEN = (17, 5)  # per row: document A is the first 17 (row 0) / 5 (row 1) tokens; B, C follow


def build_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(TINY)
    model.init_weights()
    return model


def packed_batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, the same with every token of document A replaced, document ids, mask of A's positions)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (2, SEQ), generator=g)
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    ids[0, 17:], ids[0, 40:] = 1, 2
    ids[1, 5:], ids[1, 30:] = 1, 2
    in_a = ids == 0
    changed = tokens.clone()
    shift = 1 + torch.randint(0, TINY.vocab_size - 1, (int(in_a.sum()),), generator=g)
    changed[in_a] = (tokens[in_a] + shift) % TINY.vocab_size
    assert (changed[in_a] != tokens[in_a]).all() and torch.equal(changed[~in_a], tokens[~in_a])
    return tokens, changed, ids, in_a


@pytest.mark.parametrize("restart_positions", [False, True])
def test_other_documents_cannot_change_a_logit(restart_positions):
    model = build_model()
    tokens, changed, ids, in_a = packed_batches()
    kw = {"document_ids": ids, "positions": positions_in_documents(ids) if restart_positions else None}
    with torch.no_grad():
        before, after = model(tokens, **kw), model(changed, **kw)
    assert torch.equal(before[~in_a], after[~in_a])  # difference exactly 0
    assert not torch.allclose(before[in_a], after[in_a])


def test_without_masking_the_same_check_shows_the_leak():
    model = build_model()
    tokens, changed, _, in_a = packed_batches()
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert (before[~in_a] - after[~in_a]).abs().amax(-1).min() > 1e-4  # every later token is affected


def test_a_packed_document_with_restarted_positions_equals_it_alone():
    model = build_model()
    tokens, _, ids, _ = packed_batches()
    with torch.no_grad():
        packed = model(tokens, document_ids=ids, positions=positions_in_documents(ids))
        alone = model(tokens[:1, 17:40])  # row 0's document B as a sequence of its own
    # The packed row takes the document blocks, the lone one plain SDPA: two float32 forward passes. Measured: uses
    # 0.0016 of it (AVX-512), 0.0016 (AVX2 caps).
    tol = logits_tol(alone, TINY.n_layers, contraction_width(model, SEQ))
    torch.testing.assert_close(packed[0, 17:40], alone[0], **tol)


def test_blockwise_cpu_path_equals_dense_masked_attention(monkeypatch):
    """Query blocks of 8 with key spans from each block's earliest document start (the CPU flash blocks the
    kernel takes in eager mode): same as the full mask."""
    monkeypatch.setattr(attention, "DOCUMENT_BLOCK", 8)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, SEQ, 16, generator=g) for _ in range(3))
    _, _, ids, _ = packed_batches()
    pos = torch.arange(SEQ)
    mask = attention.document_causal_mask(ids, ids, pos, pos).unsqueeze(1)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # Blocks of 8 against one masked SDPA call, float32. Measured: uses 0.014 of it (AVX-512), 0.012 (AVX2 caps).
    got = attention.ScaledDotProductAttention()(q, k, v, ids)
    torch.testing.assert_close(got, dense, **attention_tol(dense, SEQ, 16))


def test_loader_marks_documents_by_bos_and_restarts_positions():
    tok = build_tokenizer(None)
    docs = [tok.encode(t, bos=True, eos=True) for t in ("first document here", "second", "and a third one")]
    stream = [t for d in docs for t in d]
    window = Window(torch.tensor(stream[3:]))  # starts inside the first document
    inputs, labels = make_sample(window, 0, SampleFeatures(document_ids=True, document_positions=True,
                                                           bos_id=tok.bos_id))
    n0, n1 = len(docs[0]) - 3, len(docs[1])
    expected_ids = [0] * n0 + [1] * n1 + [2] * (len(docs[2]) - 1)
    assert inputs["document_ids"].tolist() == expected_ids
    assert inputs["positions"].tolist() == list(range(n0)) + list(range(n1)) + list(range(len(docs[2]) - 1))
    assert torch.equal(document_ids_from_bos(inputs["tokens"], tok.bos_id), inputs["document_ids"])
    assert torch.equal(labels, window.tokens[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention path: CUDA only")
def test_flex_attention_on_cuda_is_exact_and_matches_dense_masking():
    model = build_model().cuda()
    tokens, changed, ids, in_a = (t.cuda() for t in packed_batches())
    with torch.no_grad():
        before, after = model(tokens, document_ids=ids), model(changed, document_ids=ids)
    assert torch.equal(before[~in_a], after[~in_a])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, SEQ, 16, generator=g).cuda() for _ in range(3))
    pos = torch.arange(SEQ, device="cuda")
    mask = attention.document_causal_mask(ids, ids, pos, pos).unsqueeze(1)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    got = attention.ScaledDotProductAttention()(q, k, v, ids)
    torch.testing.assert_close(got, dense, **attention_tol(dense, SEQ, 16))


def test_compiled_cpu_model_is_exact_across_documents_and_matches_eager():
    """Compiled on CPU the blocks take the full [S, S] mask path (see models/common/attention.py): still exactly
    zero change from another document, and the same logits as eager up to inductor's fp32 reordering
    (measured 7e-7 at most; logits up to 4 in size)."""
    from torchtitan.distributed.compile import apply_compile

    model = build_model()
    tokens, changed, ids, in_a = packed_batches()
    with torch.no_grad():
        eager = model(tokens, document_ids=ids)
        apply_compile(model)
        before, after = model(tokens, document_ids=ids), model(changed, document_ids=ids)
    assert torch.equal(before[~in_a], after[~in_a])  # difference exactly 0
    assert not torch.allclose(before[in_a], after[in_a])
    # inductor fuses and reorders the float32 sums: two forward passes. Measured: uses 0.0051 of it (AVX-512), 0.0051
    # (AVX2 caps). A graph the AVX-512 run cached, loaded under the caps, gave NaN logits: the compile cache is one
    # folder per CPU kernel set since (distributed/compile.configure_compile_cache).
    torch.testing.assert_close(before, eager, **logits_tol(eager, TINY.n_layers, contraction_width(model, SEQ)))


def test_values_narrower_than_queries_take_the_exact_loop_on_cpu():
    """MLA's values are narrower than its query/key heads, which SDPA's CPU flash kernel refuses: documents then
    run the plain-torch span loop, exact against the dense mask (outputs and gradients)."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, SEQ, 8, generator=g), torch.randn(2, 2, SEQ, 8, generator=g)
    v, dout = torch.randn(2, 2, SEQ, 6, generator=g), torch.randn(2, 4, SEQ, 6, generator=g)
    _, _, ids, _ = packed_batches()
    pos = torch.arange(SEQ)
    mask = attention.document_causal_mask(ids, ids, pos, pos).unsqueeze(1)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

    got = run(lambda q, k, v: attention.ScaledDotProductAttention()(q, k, v, ids))
    want = run(lambda q, k, v: F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                              attn_mask=mask))
    # the span loop against one masked SDPA call, float32. Measured: uses 0.03 of it (AVX-512), 0.03 (AVX2 caps).
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **attention_tol(b, SEQ, 8, gradient=name != "out"), msg=name)
