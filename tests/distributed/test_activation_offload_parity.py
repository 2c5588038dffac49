"""Activation offload composes with FSDP, TP and PP and changes no number.

Each layout trains the parity recipe (fp32, deterministic, 4 steps) twice: as it is, and with every block's
saved activations offloaded to files (--memory.block_choices offload). Losses and grad norms must be bitwise
equal: offload hands back the same bytes in the same layout, so backward runs the same kernels on the same
values. Each offloaded run must really have offloaded (the tier wrote groups on every rank). The unit tests
(tests/unit/test_activation_offload.py) hold the negative control: a tier that flips one bit is caught by the
same comparison.
"""

import pytest

from tests.distributed.trainer_runs import curves, train
from torchtitan.distributed.activation_offload import OffloadedBlock

pytestmark = pytest.mark.distributed

STEPS = ["--training.steps", "4"]
LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    # Two stages per rank and a schedule that splits backward into input and weight passes.
    "pp2": (2, ["--model.flavor", "debugmodel_tiny4", "--parallelism.pipeline_parallel_degree", "2",
                "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble",
                "--training.local_batch_size", "4"]),
}


def _groups_written(trainer) -> int:
    tiers = {id(b.offloader.tier): b.offloader.tier for part in trainer.model_parts
             for b in part.layers.values() if isinstance(b, OffloadedBlock)}
    return sum(t._count for t in tiers.values())


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_offload_is_bitwise_identical_under_layout(layout, tmp_path):
    world, argv = LAYOUTS[layout]
    ref, _ = train(world, STEPS + argv, str(tmp_path / "plain"))
    got, written = train(world, STEPS + argv + ["--memory.block_choices", "offload",
                                                 "--memory.offload_dir", str(tmp_path)],
                         str(tmp_path / "offload"), probe=_groups_written)
    assert len(ref) == 4
    assert [m["loss"] for m in got] == [m["loss"] for m in ref]
    assert [m["grad_norm"] for m in got] == [m["grad_norm"] for m in ref]
    assert all(n > 0 for n in written), written
    assert curves(got)[0][-1] < curves(got)[0][0]  # it trained
