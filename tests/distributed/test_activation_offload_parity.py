"""Activation offload and optimizer-state offload compose with FSDP, TP and PP and change no number.

Each layout trains the parity recipe (fp32, deterministic, 4 steps) twice: as it is, and with every block's
saved activations offloaded to files, its saved tensors (offload) or, recomputed, its input (full_offload),
and under FSDP 2 and TP 2 the optimizer state too (--memory.offload_optimizer: its DTensor moments streamed
through files per block). Losses and grad norms must be bitwise equal: offload hands back the same bytes in the
same layout, so backward and AdamW run the same kernels on the same values. Each offloaded run must really have
offloaded (the tiers wrote groups on every rank). The unit tests (tests/unit/test_activation_offload.py,
test_optimizer_offload.py) hold the negative controls: a tier that flips one bit is caught by the same
comparison.
"""

import pytest

from tests.distributed.trainer_runs import curves, train
from torchtitan.distributed.activation_offload import OffloadedBlock

OPTIMIZER = ["--memory.offload_optimizer"]

pytestmark = pytest.mark.distributed

STEPS = ["--training.steps", "4"]
LAYOUTS = {  # (ranks, the layout, what the offloaded run adds)
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
              ["--memory.block_choices", "offload,full_offload", *OPTIMIZER]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"],
            ["--memory.block_choices", "full_offload,offload", *OPTIMIZER]),
    # Two stages per rank and a schedule that splits backward into input and weight passes.
    "pp2": (2, ["--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                "--training.local_batch_size", "4"],
            ["--memory.block_choices", "offload,full_offload,offload,full_offload"]),
}


def _groups_written(trainer) -> tuple[int, int, int]:
    """(groups of offloaded blocks, of full_offload blocks' inputs, of optimizer-state chunks) the tiers
    wrote on this rank."""
    blocks = [b for part in trainer.model_parts for b in part.layers.values() if isinstance(b, OffloadedBlock)]
    counts = []
    for prefetch in (True, False):  # full_offload's inputs have their own offloader, which never prefetches
        tiers = {id(b.offloader.tier): b.offloader.tier for b in blocks if b.offloader.prefetch == prefetch}
        counts.append(sum(t._count for t in tiers.values()))
    return (*counts, sum(s.tier._count for s in trainer.optimizers.state_offload or []))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_is_bitwise_identical_under_layout(layout, tmp_path):
    world, argv, offload = LAYOUTS[layout]
    ref, _ = train(world, STEPS + argv, str(tmp_path / "plain"))
    got, written = train(world, STEPS + argv + offload + ["--memory.offload_dir", str(tmp_path)],
                         str(tmp_path / "offload"), probe=_groups_written)
    assert len(ref) == 4
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    optimizer = OPTIMIZER[0] in offload
    assert all(a > 0 and i > 0 and (o > 0) == optimizer for a, i, o in written), written
    assert curves(got)[0][-1] < curves(got)[0][0]  # it trained
