"""torch.compile changes speed, not the numbers: compiled runs follow the eager curve on every layout.

The parity recipe (tests/distributed/trainer_runs.py: fp32, 10 steps) trained eagerly on one process is the
reference; compiled runs on one process (with full AC, so checkpointing inside compiled blocks is covered),
FSDP 2 and TP 2 (with full AC, the checkpoint around the compiled blocks) must match it within the parity tolerances (loss rtol 1e-5, grad norm rtol 5e-5). Inductor
fuses and reorders fp32 reductions, which moves results by a few ulps: measured <= 1.2e-7 (loss) and
<= 1.4e-5 (grad norm). A compiled loss that skips the fp32 upcast of the logits (bf16 softmax) moves the loss
by ~1e-3 and must fail the check.

Compilation dominates the time of these tests (about a minute per layout on 2 cores when the cache is cold),
so they are few, and the inductor cache ($TORCHINDUCTOR_CACHE_DIR, default under $TORCHTITAN_CACHE_DIR or
~/.cache/torchtitan) is shared by every rank and every later run.
"""

import pytest

from tests.distributed.test_parity_2d import LAYOUTS, assert_parity
from tests.distributed.trainer_runs import curves, train

pytestmark = pytest.mark.distributed

COMPILE = ["--compile.enable"]


@pytest.fixture(scope="module")
def eager_reference(tmp_path_factory):
    steps, _ = train(1, ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("eager")))
    return curves(steps)


def test_compiled_single_process_matches_eager(eager_reference, tmp_path):
    argv = ["--training.local_batch_size", "4", "--activation_checkpoint.mode", "full"] + COMPILE
    steps, _ = train(1, argv, str(tmp_path))
    assert_parity(curves(steps), eager_reference)
    # Compile time is reported as the first step's duration and kept out of throughput.
    assert "first_step_s" in steps[0] and "tps" not in steps[0]
    assert all("tps" in s and "first_step_s" not in s for s in steps[1:])


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_compiled_layout_matches_eager(layout, eager_reference, tmp_path):
    world, argv = LAYOUTS[layout]
    if layout == "tp2":
        # Full AC under TP: the checkpoint stays eager around the compiled block (distributed/compile.py; traced
        # it stopped in AOTAutograd, tests/distributed/test_compile_full_ac_tp.py). The block compiles to the
        # graph it has without AC, so this costs the recomputation, not another compile.
        argv = argv + ["--activation_checkpoint.mode", "full"]
    # Twice: the second run loads what the first compiled from the on-disk cache, and a cache that hands one
    # rank another rank's graph only shows then (it did: AOTAutograd's cache under TP, see compile.py).
    for run in ("first", "cached"):
        steps, _ = train(world, argv + COMPILE, str(tmp_path / run))
        assert_parity(curves(steps), eager_reference)


def _loss_without_upcast(rank, world_size):
    """Breaks the compiled loss on purpose: cross entropy on bf16 logits (the upcast 'optimised' away)."""
    import torch.nn.functional as F

    import torchtitan.components.loss as loss_mod

    def bf16_cross_entropy_sum(logits, labels):
        return F.cross_entropy(
            logits.flatten(0, 1).bfloat16(), labels.flatten(0, 1), reduction="sum", ignore_index=-100
        ).float()

    loss_mod.cross_entropy_sum = bf16_cross_entropy_sum


def test_parity_check_catches_a_lossy_compiled_loss(eager_reference, tmp_path):
    steps, _ = train(1, ["--training.local_batch_size", "4"] + COMPILE, str(tmp_path), setup=_loss_without_upcast)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), eager_reference)
