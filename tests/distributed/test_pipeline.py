"""Pipeline parallelism changes where layers run, never the numbers.

The parity protocol of test_parity_2d.py (same tiny fp32 model, initial weights and global batches; per-step
loss and pre-clipping grad norm against one process within tests/tolerances.py's curve tolerances) on debugmodel_tiny4, whose 4 layers
allow 2 stages per rank on 2 ranks. Validation runs at steps 5 and 10 in every run, so the pipelined
forward-only path is compared too.

Every schedule runs PP 2 with local batch 4 of the global 8: two schedule steps accumulate into one
optimizer step, each split into microbatches by the schedule. Compositions: PP 2 x FSDP 2 (a zero-bubble
schedule, whose split weight pass needs FSDP to keep stage parameters gathered), PP 2 x TP 2 (sequence-
sharded hidden states between stages, loss parallel on the last stage), and 3D PP 2 x TP 2 x FSDP 2.
"""

import pytest
import torch

from tests.distributed.test_parity_2d import LOSS_RTOL, assert_parity
from tests.distributed.trainer_runs import DOCUMENT_MASKING, curves, read_metrics, train

pytestmark = pytest.mark.distributed

COMMON = ["--model.flavor", "debugmodel_tiny4", "--validation.enable", "--validation.freq", "5", "--validation.steps", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]


def validation_batch(dp: int) -> list[str]:
    """The same 8 validation sequences per evaluation step whatever the data-parallel degree."""
    return ["--validation.local_batch_size", str(8 // dp)]


def schedule(name: str) -> list[str]:
    return ["--parallelism.pipeline_parallel_schedule", name]


SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]

# name: (world size, layout arguments)
LAYOUTS = {
    **{f"pp2_{s}": (2, PP2 + schedule(s) + validation_batch(1) + ["--training.local_batch_size", "4"])
       for s in SCHEDULES},
    "pp2_fsdp2": (4, PP2 + schedule("InterleavedZeroBubble") + validation_batch(2) + [
        "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "pp2_tp2": (4, PP2 + schedule("Interleaved1F1B") + validation_batch(1) + [
        "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4",
        "--parallelism.pipeline_parallel_microbatch_size", "2"]),
    "pp2_tp2_fsdp2": (8, PP2 + schedule("ZBVZeroBubble") + validation_batch(2) + [
        "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
        "--training.local_batch_size", "4"]),
}


def run(world: int, argv: list[str], folder: str, setup=None):
    steps, _ = train(world, COMMON + argv, folder, setup=setup)
    validation = torch.tensor(
        [m["validation/loss"] for m in read_metrics(folder) if "validation/loss" in m], dtype=torch.float64
    )
    return curves(steps), validation


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    got, validation = run(1, validation_batch(1) + ["--training.local_batch_size", "4"],
                          str(tmp_path_factory.mktemp("single")))
    assert len(got[0]) == 10 and len(validation) == 2
    return got, validation


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    got, validation = run(world, argv, str(tmp_path))
    ref, ref_validation = reference
    assert_parity(got, ref)
    torch.testing.assert_close(validation, ref_validation, rtol=LOSS_RTOL, atol=0)


# Document masking through the schedules: the ids travel to every stage as keyword inputs.
MASKED_LAYOUTS = ["pp2_1F1B", "pp2_Interleaved1F1B", "pp2_ZBVZeroBubble", "pp2_tp2"]


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory):
    return run(1, validation_batch(1) + ["--training.local_batch_size", "4"] + DOCUMENT_MASKING,
               str(tmp_path_factory.mktemp("masked")))


@pytest.mark.parametrize("layout", MASKED_LAYOUTS)
def test_pipeline_layout_matches_single_process_with_document_masking(layout, masked_reference, tmp_path):
    world, argv = LAYOUTS[layout]
    got, validation = run(world, argv + DOCUMENT_MASKING, str(tmp_path))
    ref, ref_validation = masked_reference
    assert_parity(got, ref)
    torch.testing.assert_close(validation, ref_validation, rtol=LOSS_RTOL, atol=0)


def _schedule_that_divides_by_microbatches(rank, world_size):
    """Breaks the loss scaling on purpose: torch's default scale_grads divides the already token-normalised
    gradients by the microbatch count a second time."""
    import torchtitan.distributed.pipeline as pipeline

    real = pipeline.build_schedule

    def broken(*args, **kwargs):
        s = real(*args, **kwargs)
        s.scale_grads = True
        return s

    pipeline.build_schedule = broken


def test_parity_check_catches_double_scaled_gradients(reference, tmp_path):
    world, argv = LAYOUTS["pp2_1F1B"]
    got, _ = run(world, argv, str(tmp_path), setup=_schedule_that_divides_by_microbatches)
    with pytest.raises(AssertionError):
        assert_parity(got, reference[0])
