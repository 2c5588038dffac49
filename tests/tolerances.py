"""The suite's shared numerical tolerances, each with where it comes from.

Two sources only, as the suite's rule says: the dtype's unit roundoff and the length of the reductions whose
order a layout changes, or the spread of the same comparison across the kernel sets a CPU can pick (AVX-512 with
native bf16, AVX2 only; ATen, oneDNN and MKL each dispatch per kernel set and sum in another order). The spread
is measured with `TT_TOLERANCE_LOG` (tests/conftest.py) and `scripts/diagnostics/tolerance_margins.py`, once
with the default kernels and once under the AVX2 caps (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
MKL_ENABLE_INSTRUCTIONS=AVX2`); docs/performance.md names the runs.
"""

import torch

# Unit roundoff: each rounded operation is off by at most this, relatively.
FP32_U = torch.finfo(torch.float32).eps / 2  # 5.96e-8
FP64_U = torch.finfo(torch.float64).eps / 2  # 1.11e-16
BF16_U = torch.finfo(torch.bfloat16).eps / 2  # 3.91e-3
E4M3_U = 2.0**-4  # float8 e4m3 (3 mantissa bits): 6.25e-2


def reordered_sum_rtol(n: int, condition: float = 1.0, u: float = FP32_U) -> float:
    """Relative difference two summation orders of n terms can show, as a tolerance.

    Rounding errors of a sum behave as a random walk (Higham, Accuracy and Stability, §4.2): one order is off
    by ~u sqrt(n) of sum |x| (1 sigma), so two orders differ by ~u sqrt(2n); 6 sigma of that keeps a false
    failure below 1e-8 per comparison. `condition` is sum |x| / |sum x|: a sum of terms that cancel (a gradient
    over tokens that pull both ways) moves relatively more than a sum of positive terms (a loss)."""
    return 6 * u * (2 * n) ** 0.5 * condition


def chain_tol(scale: float, depth: int, width: int, condition: float = 1.0, u: float = FP32_U) -> dict:
    """`assert_close` tolerances for two implementations of one computation that chain `depth` contractions
    (matmuls, softmax denominators, norms' mean squares) of at most `width` terms each, summed in other orders.

    Each contraction's reordering is a random walk of `width` roundings at the scale of its terms, and the
    chain's are independent, so the output moves like one sum of depth x width terms: reordered_sum_rtol of
    that. Outputs near zero keep the absolute error of their terms, which are at the output's scale: atol is
    the same fraction of `scale` (the largest |expected|). `condition` is what the chain amplifies a relative
    error by: sharp weights (logits of many units through a softmax) or a solve; each site says where its own
    comes from and what it measured."""
    rtol = reordered_sum_rtol(depth * width, condition, u)
    return {"rtol": rtol, "atol": rtol * scale}


# A transformer block chains 7 contractions: the q/k/v projections, the scores, probabilities x values, the
# output projection, the FFN's input and output projections, and one norm's mean square; the output head adds 2.
BLOCK_CONTRACTIONS = 7


def logits_tol(expected: torch.Tensor, n_layers: int, width: int, condition: float = 1.0) -> dict:
    """Two float32 forward passes of one model (ours and transformers', or eager and compiled) on the same
    weights: `width` is the longest contraction (the model width, FFN width or sequence, whichever is
    longest). chain_tol over BLOCK_CONTRACTIONS x n_layers + 2 contractions at the logits' scale."""
    return chain_tol(float(expected.abs().max()), BLOCK_CONTRACTIONS * n_layers + 2, width, condition)


def contraction_width(model: torch.nn.Module, seq: int) -> int:
    """The longest contraction of a forward pass: a linear layer's input width or the sequence (attention)."""
    return max([seq] + [p.shape[-1] for p in model.parameters() if p.dim() == 2])


def attention_tol(expected: torch.Tensor, seq: int, head_dim: int, gradient: bool = False,
                  condition: float = 1.0) -> dict:
    """One attention by two float32 kernels: the scores (head_dim terms), the softmax denominator and
    probabilities x values (seq terms each); a gradient chains the forward's three and three more (dP, the
    softmax's backward sum, dS x K or dS^T x Q)."""
    return chain_tol(float(expected.abs().max()), 6 if gradient else 3, max(seq, head_dim), condition)


def optimizer_steps_tol(steps: int, lr: float, ops_per_step: int = 8, condition: float = 1.0) -> dict:
    """Parameters after `steps` updates by two implementations of one optimizer (fused vs for-each, ours vs
    torch's) on the same batches. No reduction is reordered: each step rounds ~ops_per_step elementwise
    operations per entry (the moments, a root, a division, the decay, the subtraction), each off by u relative
    on either side, so 2 x steps x ops u relative; a parameter near zero keeps its updates' absolute error
    instead (an update entry is at most ~lr): lr times that, times what the update rule amplifies an input's
    error by (`condition`: Newton-Schulz's, for Muon)."""
    rtol = 2 * steps * ops_per_step * FP32_U
    return {"rtol": rtol, "atol": lr * rtol * condition}


# Training curves of the parity tests (float32, tiny flavors, 4-10 steps, 8 sequences x 64 tokens a step):
# per-step loss and pre-clipping grad norm of a layout against one process on the same seed and batches.
TOKENS_PER_STEP = 8 * 64

# Loss: a mean over the step's tokens of positive terms (condition 1). Layouts reorder that sum (DP, CP, PP's
# microbatches); each term's own rounding (its logits' contractions, the softmax over the vocabulary, which TP
# and loss parallel reorder) is independent per token and averages out in the mean. 6 sigma of the token sum's
# reordering: 1.1e-5. Measured spread, both kernel sets, every parity test: < 1e-6 over 10 steps. A real bug (a
# missing gradient sync, a 1/N factor, a wrong batch slice) moves the loss by >= 1e-3.
LOSS_RTOL = reordered_sum_rtol(TOKENS_PER_STEP)

# Grad norm: a gradient entry sums per-token terms of either sign, which cancel down to ~sqrt(tokens) of their
# absolute sum (condition sqrt(tokens) ~ 23): 6 sigma of that sum's reordering is 2.6e-4. The norm over many
# entries averages those errors, and Adam carries a step's difference into the later steps' weights; measured
# spread (largest relative difference of any layout at any step): 1.6e-5 without document masking, 5.72e-5 and
# 5.79e-5 with it (pipeline schedules, PP 2 x TP 2) on a Zen 3 (AVX2) and a Zen 4 (AVX-512), 4.5x below. A real
# bug moves the grad norm by >= 1e-2 (the pipeline's second division by the microbatch count: 50%).
GRAD_NORM_RTOL = reordered_sum_rtol(TOKENS_PER_STEP, condition=TOKENS_PER_STEP**0.5)


def assert_curves_close(got, ref, loss_rtol: float = LOSS_RTOL, grad_norm_rtol: float = GRAD_NORM_RTOL) -> None:
    """Per-step (loss, grad norm) curves equal within the tolerances above (no absolute slack: a curve's
    values are O(1) and never near zero)."""
    loss, gnorm = got
    ref_loss, ref_gnorm = ref
    assert loss.shape == ref_loss.shape, (loss.shape, ref_loss.shape)
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rtol, atol=0)
    torch.testing.assert_close(gnorm, ref_gnorm, rtol=grad_norm_rtol, atol=0)


def float8_drift_rtol(contraction: int) -> float:
    """Training curves of two layouts with float8 linears (tensorwise dynamic scales), after the first step.

    The first step must match to LOSS_RTOL / GRAD_NORM_RTOL (same amaxes, same scales, same roundings: that is
    where a float8 sharding bug shows). Later, the layouts' float32 noise in the weights makes an occasional
    element round to the neighbouring e4m3 value: one spacing, 2 E4M3_U of that element. In a contraction of
    `contraction` terms of either sign, whose sum is ~sqrt(contraction) terms large, one flipped term moves the
    output by 2 E4M3_U / sqrt(contraction); the loss moves by at most that when every output met a flip. Pass the
    narrowest contraction the float8 linears run (the model dim: the widest per-flip effect). At dim 64:
    1.6e-2. Measured drift over 3-10 steps: 4.5e-4 (Llama 3, FSDP/TP 2, AVX-512), 1.65e-3 (Qwen3 TP 2 with AC,
    AVX2 caps: it read 0.82 of the 2e-3 this replaced)."""
    return 2 * E4M3_U / contraction**0.5

