"""2D parallelism changes memory and speed, never the numbers.

Every layout trains the same tiny fp32 model from the same initial weights on the same global batches
(8 sequences x 64 tokens per step, 10 steps) and must log the same per-step loss and pre-clipping grad
norm as one process, within tests/tolerances.py's LOSS_RTOL (1.1e-5) and GRAD_NORM_RTOL (2.6e-4), derived
there from float32's unit roundoff and the step's token count and checked against the spread measured under
both CPU kernel sets.

Why parity holds: sharding only reorders sums (reduce-scatter vs. local accumulation, sharded norms, a
vocab-sharded softmax), which moves each result by a few ulps. The grad norm moves more than the loss because
a gradient sums per-token terms that largely cancel. A real bug (a missing gradient sync, a 1/N divide factor,
duplicated shards, a wrong batch slice) moves the loss by 1e-3 or more.
"""

import pytest
import torch

from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, train
from tests.tolerances import LOSS_RTOL, assert_curves_close as assert_parity  # noqa: F401 (LOSS_RTOL: re-export)

pytestmark = pytest.mark.distributed


# name: (world size, layout arguments). local_batch_size is chosen so several layouts also accumulate.
LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "fsdp4": (4, ["--parallelism.data_parallel_shard_degree", "4", "--training.local_batch_size", "2"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                    "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "1", "--training.local_batch_size", "4"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree", "2",
                      "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # One process, 2 microbatches of 4: accumulation is part of the reference.
    steps, _ = train(1, ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("single")))
    assert len(steps) == 10
    return curves(steps)


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory):
    steps, _ = train(1, ["--training.local_batch_size", "4"] + DOCUMENT_MASKING, str(tmp_path_factory.mktemp("masked")))
    return curves(steps)


def test_reference_learns(reference):
    loss, _ = reference
    assert loss[-1] < loss[0] - 0.5, f"the tiny model should learn in 10 steps: {loss.tolist()}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, argv, str(tmp_path))
    assert_parity(curves(steps), reference)


def test_document_masking_changes_the_run(reference, masked_reference):
    """The masked runs below really mask: attention across documents is gone, so the losses differ."""
    assert not torch.allclose(masked_reference[0], reference[0], rtol=1e-3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process_with_document_masking(layout, masked_reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, argv + DOCUMENT_MASKING, str(tmp_path))
    assert_parity(curves(steps), masked_reference)


def _fsdp_that_averages(rank, world_size):
    """Breaks FSDP on purpose: gradients averaged instead of summed (the classic 1/N bug)."""
    import torchtitan.distributed.data_parallel as dp

    real = dp.apply_fsdp

    def broken(*args, **kwargs):
        model = real(*args, **kwargs)
        for m in model.modules():
            if isinstance(m, dp.FSDPModule):
                m.set_gradient_divide_factor(float(world_size))
        return model

    dp.apply_fsdp = broken
    import torchtitan.distributed.parallelize as par  # the one composition, which calls apply_fsdp by name

    par.apply_fsdp = broken


def test_parity_check_catches_broken_sharding(reference, tmp_path):
    """The parity test has teeth: FSDP 2 with averaged gradients must fail it."""
    from tests.distributed import trainer_runs

    world, argv = LAYOUTS["fsdp2"]
    steps, _ = trainer_runs.train(world, argv, str(tmp_path), setup=_fsdp_that_averages)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference)
