"""Float8 training (torchao, emulated on CPU) follows the bf16 curve and composes with FSDP and TP.

Curve: 50 steps of debugmodel_tiny (every linear of its blocks has dims that are multiples of 16, so all 8 per
block are converted; the output projection stays high precision by the default filter), auto precision (bf16
autocast where the CPU multiplies bf16 natively; fp32 where it would emulate bf16 ~100x slower) vs float8
tensorwise. Distance = max over steps of |EMA(loss_f8) - EMA(loss_bf16)| with EMA factor 0.9, which
smooths the per-batch noise and keeps drift. Measured: see GAP_LIMIT.

Layouts: float8 on FSDP 2 and TP 2 must match float8 on one process (fp32, the parity recipe) within the
parity-test tolerances: tensorwise scales come from the amax of the whole tensor (all-reduced when sharded),
so every layout casts the same values to float8 and only fp32 summation order differs, provided every forward
sees the same microbatch (activation scales are per forward). The first 3 steps must match within the parity
tolerances; after that float8 rounding amplifies fp32 noise (measured <= 4.5e-4 relative loss by step 10), so
the whole curve is held to 2e-3.
"""

import pytest
import torch

from tests.distributed.test_parity_2d import LAYOUTS, assert_parity
from tests.distributed.trainer_runs import curves, train
from tests.tolerances import float8_drift_rtol

pytestmark = pytest.mark.distributed

F8 = ["--model.converters", "float8", "--float8.emulate"]
CURVE_ARGS = ["--training.steps", "50", "--training.local_batch_size", "8",
              "--training.mixed_precision_param", "auto", "--optimizer.lr", "1e-2"]
# Measured: float8 0.0050; float8 with its scaling broken (test below) 0.060. The limit sits between, 4x above
# the healthy gap so that platform rounding differences do not flip it.
GAP_LIMIT = 0.02


def _count_float8_linears(trainer) -> int:
    return sum(type(m).__name__ == "Float8Linear" for part in trainer.model_parts for m in part.modules())


def smoothed_gap(loss: torch.Tensor, ref: torch.Tensor, beta: float = 0.9) -> float:
    def ema(x):
        out, acc = [], x[0]
        for v in x:
            acc = beta * acc + (1 - beta) * v
            out.append(acc)
        return torch.stack(out)

    return (ema(loss) - ema(ref)).abs().max().item()


@pytest.fixture(scope="module")
def bf16_curve(tmp_path_factory):
    steps, _ = train(1, CURVE_ARGS, str(tmp_path_factory.mktemp("bf16")))
    return curves(steps)[0]


@pytest.fixture(scope="module")
def float8_run(tmp_path_factory):
    steps, counts = train(1, CURVE_ARGS + F8, str(tmp_path_factory.mktemp("f8")), probe=_count_float8_linears)
    return curves(steps)[0], counts[0]


def test_float8_converts_the_block_linears(float8_run):
    _, converted = float8_run
    assert converted == 2 * 7  # debugmodel_tiny: 2 blocks x (wq, wk, wv, wo, w1, w2, w3); output filtered


def test_float8_follows_the_bf16_curve(float8_run, bf16_curve):
    loss, _ = float8_run
    assert len(loss) == 50
    gap = smoothed_gap(loss, bf16_curve)
    print(f"float8 vs bf16: smoothed max gap {gap:.4f}, final {loss[-1]:.4f} vs {bf16_curve[-1]:.4f}")
    assert loss[-1] < loss[0] - 1.0, "the model should learn"
    assert gap <= GAP_LIMIT


def _unscaled_float8(rank, world_size):
    """Breaks float8 on purpose: every scale is 1, so small gradients underflow float8 (the classic missing
    scaling bug)."""
    import torchao.float8.float8_utils as fu

    fu.amax_to_scale = lambda amax, float8_dtype, round_scales_to_power_of_2=False: torch.ones_like(
        amax, dtype=torch.float32
    )


def test_gap_check_catches_unscaled_float8(bf16_curve, tmp_path):
    steps, _ = train(1, CURVE_ARGS + F8, str(tmp_path), setup=_unscaled_float8)
    gap = smoothed_gap(curves(steps)[0], bf16_curve)
    print(f"unscaled float8 vs bf16: smoothed max gap {gap:.4f}")
    assert gap > GAP_LIMIT


# Dynamic scaling takes each forward's activation amax over its microbatch, so layouts are compared with the
# same microbatches (2 sequences): a 4-sequence microbatch has another amax, other scales and other roundings
# (measured: 0.6% loss difference by step 9, far above the parity tolerance).
MICROBATCH_2 = ["--training.local_batch_size", "2"]
EARLY_STEPS, CURVE_RTOL = 3, float8_drift_rtol(64)  # debugmodel_tiny's dim


@pytest.fixture(scope="module")
def float8_reference(tmp_path_factory):
    steps, _ = train(1, MICROBATCH_2 + F8, str(tmp_path_factory.mktemp("f8ref")))
    return curves(steps)


@pytest.mark.parametrize(
    "layout,extra",
    [
        ("fsdp2", []),
        ("fsdp2", ["--float8.enable_fsdp_float8_all_gather", "--float8.precompute_float8_dynamic_scale_for_fsdp"]),
        ("tp2", []),
    ],
    ids=["fsdp2", "fsdp2_float8_all_gather", "tp2"],
)
def test_float8_layout_matches_single_process(layout, extra, float8_reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, counts = train(world, argv + MICROBATCH_2 + F8 + extra, str(tmp_path), probe=_count_float8_linears)
    assert all(c == 2 * 7 for c in counts)
    loss, gnorm = curves(steps)
    ref_loss, ref_gnorm = float8_reference
    # The first steps agree to fp32 noise, like any layout; later the noise flips an occasional float8 rounding
    # and the curves drift apart (tests/tolerances.float8_drift_rtol), measured up to 4.5e-4 relative by step 10.
    assert_parity((loss[:EARLY_STEPS], gnorm[:EARLY_STEPS]), (ref_loss[:EARLY_STEPS], ref_gnorm[:EARLY_STEPS]))
    torch.testing.assert_close(loss, ref_loss, rtol=CURVE_RTOL, atol=0)
