"""The chunked cross entropy equals the plain one: the loss and the gradients of the logits, and through the
output projection of its hidden states and weight (fp32, 1e-6), with masked (SFT) labels and a last chunk
shorter than the others; the per-source sums too; a trainer run with chunking logs the plain run's losses;
bad chunk sizes are one line before any rank starts. (TP's loss parallel: tests/distributed/
test_muon_parity.py (with chunked_loss_parallel.py).)"""

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import BF16_U, chain_tol, reordered_sum_rtol
from tests.unit.checkpoint_helpers import losses, run
from tests.unit.checkpoint_helpers import TINY
from torchtitan import preflight
from torchtitan.components.loss import chunked_loss
from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum, per_source_loss_sums


def _batch(seed=0, b=2, s=37, dim=16, vocab=50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(b, s, dim, generator=g, dtype=torch.float64).float()
    w = torch.randn(vocab, dim, generator=g) * dim**-0.5
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :5] = IGNORE_INDEX  # a prompt the SFT mask leaves out
    labels[1, -3:] = IGNORE_INDEX
    return h, w, labels


def _loss_and_grads(loss_fn, h, w, labels):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    logits = F.linear(h, w)
    logits.retain_grad()
    loss = loss_fn(logits, labels)
    (loss / 100).backward()
    return loss.detach(), logits.grad, h.grad, w.grad


def _recomputed(logits, labels):
    """The plain loss under another name: chunked_loss then takes its recompute path (DTensor, compile)."""
    return cross_entropy_sum(logits, labels)


@pytest.mark.parametrize("kernel", [cross_entropy_sum, _recomputed], ids=["written-out", "recomputed"])
@pytest.mark.parametrize("chunk", [1, 8, 36])
def test_loss_and_gradients_equal_the_unchunked_ones(chunk, kernel):
    h, w, labels = _batch()
    expected = _loss_and_grads(cross_entropy_sum, h, w, labels)
    got = _loss_and_grads(chunked_loss(kernel, chunk), h, w, labels)
    # Two chained sums of at most max(tokens, vocab) terms: the log-sum-exp over the vocabulary, then the
    # loss over tokens (or the gradients' contractions over the vocabulary and over tokens). Measured: uses 0.014 of it
    # (AVX-512), 0.014 (AVX2 caps).
    width = max(labels.numel(), w.shape[0])
    for name, e, g in zip(["loss", "logits grad", "hidden grad", "weight grad"], expected, got):
        torch.testing.assert_close(g, e, **chain_tol(e.abs().max().item(), 2, width), msg=name)
    assert expected[0] > 0 and expected[1].abs().sum() > 0  # a real loss and gradient were compared


def test_bf16_logits_get_a_bf16_gradient_and_no_grad_is_the_plain_sum():
    h, w, labels = _batch(1)
    logits = F.linear(h, w).bfloat16().requires_grad_()
    loss = chunked_loss(cross_entropy_sum, 8)(logits, labels)
    loss.backward()
    plain = logits.detach().clone().requires_grad_()
    cross_entropy_sum(plain, labels).backward()
    assert logits.grad.dtype == torch.bfloat16
    # Both gradients are float32 values rounded to bf16 once; their float32 values differ by a reordering, so
    # a rounding can land one bf16 ulp (2u of bf16) apart: 2u relative, and 2u of the largest for the entries
    # that round to near zero. Measured: equal on both kernel sets. A wrong scale moves it by >= 1/chunks.
    scale = plain.grad.abs().max().item()
    torch.testing.assert_close(logits.grad, plain.grad, rtol=2 * BF16_U, atol=2 * BF16_U * scale)
    with torch.no_grad():
        torch.testing.assert_close(chunked_loss(cross_entropy_sum, 8)(logits, labels), loss.detach())


def test_per_source_sums_over_chunks_equal_the_whole_sequence(monkeypatch):
    from torchtitan.components import loss as loss_module

    h, w, labels = _batch(2, s=40)
    logits = F.linear(h, w)
    source_ids = torch.randint(0, 3, labels.shape, generator=torch.Generator().manual_seed(3))
    whole = per_source_loss_sums(logits, labels, source_ids, 3)
    monkeypatch.setattr(loss_module, "_SOURCE_LOSS_CHUNK", 7)
    # the same two chained sums as above, split by source. Measured: uses 0.012 of it (AVX-512), 0.012 (AVX2 caps).
    tol = chain_tol(whole.abs().max().item(), 2, max(labels.numel(), logits.shape[-1]))
    torch.testing.assert_close(per_source_loss_sums(logits, labels, source_ids, 3), whole, **tol)
    assert whole[1].sum() == (labels != IGNORE_INDEX).sum()


def test_trainer_with_chunked_loss_logs_the_plain_losses(tmp_path):
    assert run(tmp_path / "plain", "--training.steps", "2") == 0
    assert run(tmp_path / "chunked", "--training.steps", "2", "--training.loss_chunk_size", "8") == 0
    # Training curves: a step's loss is a mean over its 4 x 32 tokens, reordered (tests/tolerances.py). Measured: uses
    # 0.021 of it (AVX-512), 0.021 (AVX2 caps).
    torch.testing.assert_close(torch.tensor(losses(tmp_path / "chunked")), torch.tensor(losses(tmp_path / "plain")),
                               rtol=reordered_sum_rtol(4 * 32), atol=0)


@pytest.mark.parametrize("size, message", [
    ("0", "--training.loss_chunk_size must be -1 (auto) or at least 1, got 0"),
    ("33", "--training.loss_chunk_size 33 is longer than the sequence (--training.seq_len 32)"),
])
def test_bad_chunk_size_is_one_line(tmp_path, capsys, size, message):
    argv = ["--world-size", "2", *TINY, "--job.dump_folder", str(tmp_path), "--training.loss_chunk_size", size]
    assert preflight.main(argv) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_default_chunks_only_an_eager_loss_over_a_large_vocabulary():
    """-1 (the default): chunked (AUTO_CHUNK positions) where auto_chunks says it pays, the plain loss else;
    training.seq_len is always the plain loss. Same sums either way."""
    from torchtitan.components.loss import AUTO_MIN_POSITIONS, AUTO_MIN_VOCAB, auto_chunks, build_cross_entropy_loss
    from torchtitan.config.job_config import JobConfig

    def grad_fn_name(cfg, vocab, positions=AUTO_MIN_POSITIONS):
        torch.manual_seed(0)
        logits = torch.randn(1, positions, vocab, dtype=torch.bfloat16, requires_grad=True)
        labels = torch.randint(0, vocab, (1, positions))
        loss = build_cross_entropy_loss(cfg)(logits, labels)
        return type(loss.grad_fn).__name__, loss.detach()

    cfg = JobConfig()
    cfg.training.seq_len = AUTO_MIN_POSITIONS
    assert cfg.training.loss_chunk_size == -1
    big, plain_big = grad_fn_name(cfg, AUTO_MIN_VOCAB)
    small, _ = grad_fn_name(cfg, AUTO_MIN_VOCAB // 2)
    short, _ = grad_fn_name(cfg, AUTO_MIN_VOCAB, AUTO_MIN_POSITIONS // 2)
    assert "Chunked" in big and "Chunked" not in small and "Chunked" not in short, (big, small, short)
    cfg.training.loss_chunk_size = cfg.training.seq_len
    off, plain = grad_fn_name(cfg, AUTO_MIN_VOCAB)
    assert "Chunked" not in off
    # a bf16 loss summed in float32 over the positions, chunked or not: the loss's two chained sums. Measured: uses
    # 0.00068 of it (AVX-512), 0.00068 (AVX2 caps).
    rtol = chain_tol(1.0, 2, max(AUTO_MIN_POSITIONS, AUTO_MIN_VOCAB))["rtol"]
    torch.testing.assert_close(plain_big.float(), plain.float(), rtol=rtol, atol=0)
    assert not auto_chunks(AUTO_MIN_VOCAB, AUTO_MIN_POSITIONS, compiled=True, loss_parallel=False)
    assert not auto_chunks(AUTO_MIN_VOCAB, AUTO_MIN_POSITIONS, compiled=False, loss_parallel=True)
