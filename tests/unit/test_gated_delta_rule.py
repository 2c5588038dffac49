"""The chunked gated delta rule against its recurrent form and a naive loop written another way (the state
update as a matrix product S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, per head), in float64:
outputs, final states and gradients, with an initial state, grouped heads, a ragged last chunk and document
resets; and against transformers' torch_chunk_gated_delta_rule."""

import pytest
import torch

from tests.tolerances import FP32_U, FP64_U, chain_tol
from torchtitan.models.common.gated_delta_rule import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule


def _naive(q, k, v, g, beta, initial_state, resets):
    """Per batch row, per v head, per token: explicit matrices."""
    bsz, seq, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5
    out = torch.zeros(bsz, seq, hv, dv, dtype=v.dtype)
    final = torch.zeros(bsz, hv, dk, dv, dtype=v.dtype)
    eye = torch.eye(dk, dtype=v.dtype)
    for b in range(bsz):
        for h in range(hv):
            kh = h // (hv // hk)
            s = initial_state[b, h].clone()
            for t in range(seq):
                if resets is not None and resets[b, t]:
                    s = torch.zeros_like(s)
                kt = k[b, t, kh].unsqueeze(-1)  # [dk, 1]
                s = torch.exp(g[b, t, h]) * (eye - beta[b, t, h] * kt @ kt.T) @ s + beta[b, t, h] * kt @ v[b, t, h][None]
                out[b, t, h] = s.T @ (q[b, t, kh] * scale)
            final[b, h] = s
    return out, final


def _inputs(seq, hk=2, hv=4, dk=8, dv=6, bsz=2, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(bsz, seq, hk, dk, generator=gen, dtype=dtype))
    k = l2norm(torch.randn(bsz, seq, hk, dk, generator=gen, dtype=dtype))
    v = torch.randn(bsz, seq, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(bsz, seq, hv, generator=gen, dtype=dtype) * 0.5
    beta = torch.rand(bsz, seq, hv, generator=gen, dtype=dtype)
    s0 = torch.randn(bsz, hv, dk, dv, generator=gen, dtype=dtype) * 0.3
    return q, k, v, g, beta, s0


def _tol(expected, seq, width=16, u=FP64_U):
    """Ways of one recurrence: the state passes through `seq` updates, each a contraction of at most `width`
    terms (dk, dv, or the chunk's triangular solve), summed in other orders; float64 unless said."""
    return chain_tol(expected.abs().max().item(), seq, width, u=u)


def _resets(bsz, seq):
    r = torch.zeros(bsz, seq, dtype=torch.bool)
    r[0, [5, 6, 17]] = True  # a one-token document, a start in the middle of a chunk
    r[1, [8, 16]] = True  # starts exactly at chunk boundaries (chunk 8)
    return r


@pytest.mark.parametrize("with_resets", [False, True])
def test_chunked_equals_recurrent_equals_naive_fp64(with_resets):
    seq = 21  # two full chunks of 8 and a ragged one
    q, k, v, g, beta, s0 = _inputs(seq)
    resets = _resets(2, seq) if with_resets else None
    ref_o, ref_s = _naive(q, k, v, g, beta, s0, resets)
    for o, s in (
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=s0, resets=resets),
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, resets=resets),
    ):
        # Measured: uses 0.018 of it (AVX-512), 0.018 (AVX2 caps).
        torch.testing.assert_close(o, ref_o, **_tol(ref_o, seq))
        torch.testing.assert_close(s, ref_s, **_tol(ref_s, seq))


def test_gradients_fp64_and_chunk_size_free():
    seq = 19
    base = _inputs(seq, seed=1)
    resets = _resets(2, seq)

    def grads(fn):
        leaves = [t.clone().requires_grad_() for t in base]
        o, s = fn(*leaves)
        gen = torch.Generator().manual_seed(7)
        (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().backward(retain_graph=True)
        (s * torch.randn(s.shape, generator=gen, dtype=s.dtype)).sum().backward()
        return [t.grad for t in leaves]

    rec = grads(lambda q, k, v, g, b, s0: recurrent_gated_delta_rule(q, k, v, g, b, initial_state=s0, resets=resets))
    for chunk in (4, 16, 64):
        got = grads(lambda q, k, v, g, b, s0: chunk_gated_delta_rule(
            q, k, v, g, b, chunk_size=chunk, initial_state=s0, resets=resets))
        for a, b in zip(got, rec):
            # backward: the recurrence twice. Measured: uses 0.027 of it (AVX-512), 0.027 (AVX2 caps).
            torch.testing.assert_close(a, b, **_tol(b, 2 * seq))


def test_a_document_runs_as_if_alone():
    seq = 24
    q, k, v, g, beta, s0 = _inputs(seq, bsz=1, seed=2)
    resets = torch.zeros(1, seq, dtype=torch.bool)
    resets[0, 11] = True
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, resets=resets, initial_state=s0)
    alone, _ = chunk_gated_delta_rule(*(t[:, 11:] for t in (q, k, v, g, beta)), chunk_size=8)
    # Measured: uses 0.0072 of it (AVX-512), 0.0072 (AVX2 caps).
    torch.testing.assert_close(o[:, 11:], alone, **_tol(alone, seq))


def test_state_passing_splits_a_sequence():
    """Running two halves with the first half's final state handed over equals one run (what CP relies on)."""
    seq = 32
    q, k, v, g, beta, s0 = _inputs(seq, seed=3)
    whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, initial_state=s0)
    a, s_a = chunk_gated_delta_rule(*(t[:, :13] for t in (q, k, v, g, beta)), chunk_size=8, initial_state=s0)
    b, s_b = chunk_gated_delta_rule(*(t[:, 13:] for t in (q, k, v, g, beta)), chunk_size=8, initial_state=s_a)
    # Measured: uses 0.0091 of it (AVX-512), 0.0091 (AVX2 caps).
    torch.testing.assert_close(torch.cat([a, b], 1), whole, **_tol(whole, seq))
    torch.testing.assert_close(s_b, s_whole, **_tol(s_whole, seq))


def test_matches_transformers_torch_chunk_fp32():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta, s0 = (t.float() for t in _inputs(150, hk=2, hv=4, dk=16, dv=8, seed=4))
    ours, s_ours = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=s0)
    # transformers normalises q/k itself here; ours were normalised once already (l2norm is idempotent to ~1e-7).
    ref, s_ref = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=s0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=False)
    # float32, chunks of 64: Measured: uses 0 of it (AVX-512), 0 (AVX2 caps).
    torch.testing.assert_close(ours, ref, **_tol(ref, 150, 64, FP32_U))
    torch.testing.assert_close(s_ours, s_ref, **_tol(s_ref, 150, 64, FP32_U))
