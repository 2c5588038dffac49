"""Muon under FSDP and TP equals Muon in one process.

Newton-Schulz needs each whole matrix; torchtitan gathers the sharded momentum, orthogonalises it on every
rank and keeps the local shard (torchtitan/components/muon.py). Proved two ways:
- the trainer, fp32, same seed and batches (tests/distributed/trainer_runs.py): FSDP 2, TP 2 and
  TP 2 x FSDP 2 log the same per-step loss and grad norm as one process, within the 2D parity tests'
  tolerances (loss 1e-5, grad norm 5e-5, relative; test_parity_2d.py explains them). Measured over 10
  steps: loss <= 1.3e-7, grad norm <= 2.2e-5.
- the orthogonalisation alone on a 2 x 2 mesh, for every placement the appliers produce (FSDP Shard(0),
  TP Shard(0)/Shard(1), both, and FSDP-over-TP's strided shard), uneven shards too: bit-identical
  to one process.
Negative control: orthogonalising only the local shard (the tempting shortcut) fails the parity.
"""

import pytest
import torch

from tests.distributed.test_parity_2d import LAYOUTS, assert_parity
from tests.distributed.trainer_runs import curves, train
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.distributed

MUON = ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, _ = train(1, MUON + ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("single")))
    assert len(steps) == 10
    loss, _ = curves(steps)
    assert loss[-1] < loss[0] - 0.5, f"the tiny model should learn in 10 steps: {loss.tolist()}"
    return curves(steps)


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2_fsdp2"])
def test_muon_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, MUON + argv, str(tmp_path))
    assert_parity(curves(steps), reference)


def _orthogonalise_local_shard_only(rank, world_size):
    """Breaks Muon on purpose: each rank orthogonalises its own shard of the momentum as if it were the
    whole matrix (no gather)."""
    from torch.distributed.tensor import DTensor

    from torchtitan.components import muon

    def local_only(update, steps, ns_dtype):
        if not isinstance(update, DTensor):
            return muon.newton_schulz(update, steps, torch.float32)
        ortho = muon.newton_schulz(update.to_local(), steps, torch.float32).to(update.dtype)
        return DTensor.from_local(ortho, update.device_mesh, update.placements, run_check=False,
                                  shape=update.shape, stride=update.stride())

    muon.orthogonalise = local_only


def test_parity_catches_orthogonalising_the_local_shard(reference, tmp_path):
    world, argv = LAYOUTS["fsdp2"]
    steps, _ = train(world, MUON + argv, str(tmp_path), setup=_orthogonalise_local_shard_only)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference)


def _orthogonalise_on_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from torchtitan.components.muon import newton_schulz, orthogonalise

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    results = []
    for shape in [(24, 40), (25, 39)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        expected = newton_schulz(g, 5, torch.float32)
        layouts = [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1))]
        if shape[0] % 4 == 0:  # distribute_tensor cannot build an uneven strided shard (FSDP pads its own)
            layouts.append((_StridedShard(0, split_factor=2), Shard(0)))
        for placements in layouts:
            sharded = distribute_tensor(g, mesh, placements)
            got = orthogonalise(sharded, 5, "float32")
            local_expected = distribute_tensor(expected, mesh, placements).to_local()
            results.append((shape, str(placements), got.placements == sharded.placements,
                            torch.equal(got.to_local(), local_expected)))
    return results


def test_orthogonalise_every_placement_equals_one_process():
    for rank_results in run_ranks(_orthogonalise_on_mesh, 4):
        for shape, placements, same_placements, equal in rank_results:
            assert same_placements and equal, (shape, placements)
