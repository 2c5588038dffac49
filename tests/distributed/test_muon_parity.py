"""Muon under FSDP, TP and EP equals Muon in one process, with each matrix's Newton-Schulz done once.

Newton-Schulz needs each whole matrix; torchtitan gathers each sharded update to one owner rank of its
mesh, which orthogonalises it and scatters the result back (torchtitan/components/optim/muon_distributed.py).
Proved three ways:
- the trainer, fp32, same seed and batches (tests/distributed/trainer_runs.py): FSDP 2 and TP 2 x FSDP 2
  log the same per-step loss and grad norm as one process, within the 2D parity tests' tolerances (loss
  1e-5, grad norm 5e-5, relative; test_parity_2d.py explains them); so does the MoE debug model
  (deepseek_v3: attention, router gates and dense FFNs are Muon matrices beside the AdamW experts) under
  EP 2 on 4 ranks, its Muon matrices under FSDP 4, within the same tolerances. There the probe counts each
  rank's Newton-Schulz FLOPs: every matrix is orthogonalised exactly once over the four ranks (the FLOPs
  sum to one process's), and each rank's share is at most total/4 + the largest matrix's (assign_owners'
  bound).
- the orthogonalisation alone on a 2 x 2 mesh, for every placement the appliers produce (FSDP Shard(0),
  TP Shard(0)/Shard(1), both, FSDP-over-TP's strided shard, replicated), uneven shards too, all in one call
  (one schedule of gathers and scatters): bit-identical to one process.
Negative control: orthogonalising only the local shard (the tempting shortcut) fails the parity.
The same 4-rank group also runs the chunked cross entropy under TP's loss parallel
(tests/distributed/chunked_loss_parallel.py), to spare a spawn.
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


def _ns_work(trainer):
    """(this rank's Newton-Schulz FLOPs over the run, one process's FLOPs per step, the largest matrix's)."""
    from torchtitan.components.optim.muon_distributed import ns_flops

    (optimizer,) = trainer.optimizers.optimizers
    shapes = [tuple(p.shape) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    per_matrix = [ns_flops(shape, optimizer.defaults["ns_steps"]) for shape in shapes]
    return optimizer.orthogonaliser.flops_done, sum(per_matrix), max(per_matrix)


def _assert_once_per_matrix_and_balanced(work, n_steps: int, n_ranks: int) -> None:
    done = [w[0] for w in work]
    _, per_step, largest = work[0]
    assert sum(done) == per_step * n_steps, "each matrix orthogonalised exactly once per step"
    assert max(done) <= (per_step / n_ranks + largest) * n_steps, (done, per_step, largest)
    assert min(done) > 0  # every rank took a share


# TP 2 alone is covered by TP 2 x FSDP 2 and by the placement test below; FSDP 4 by the EP test (its dense
# matrices are sharded over all four ranks).
@pytest.mark.parametrize("layout", ["fsdp2", "tp2_fsdp2"])
def test_muon_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, MUON + argv, str(tmp_path))
    assert_parity(curves(steps), reference)


def test_muon_under_expert_parallel_and_fsdp4_matches_single_process(tmp_path):
    """EP 2 on 4 ranks: the experts (AdamW) are split over ep 2 x fsdp 2, the Muon matrices (attention,
    router gates, dense and shared-expert FFNs) over FSDP 4, where the probe counts the Newton-Schulz work."""
    from tests.distributed.test_moe_parity import LAYOUTS as MOE_LAYOUTS
    from tests.distributed.test_moe_parity import MOE

    moe_muon = MOE + MUON + ["--training.steps", "3"]
    single, _ = train(1, moe_muon + ["--training.local_batch_size", "4"], str(tmp_path / "single"))
    world, argv = MOE_LAYOUTS["ep2_fsdp2"]
    ep, work = train(world, moe_muon + argv, str(tmp_path / "ep"), probe=_ns_work)
    assert len(ep) == 3 and world == 4
    assert_parity(curves(ep), curves(single))
    _assert_once_per_matrix_and_balanced(work, 3, 4)


def _orthogonalise_local_shard_only(rank, world_size):
    """Breaks Muon on purpose: each rank orthogonalises its own shard of the update as if it were the
    whole matrix (no gather)."""
    from torch.distributed.tensor import DTensor

    from torchtitan.components.optim.muon_distributed import DistributedOrthogonaliser

    def local_only(self, updates, steps, ns):
        return [DTensor.from_local(ns(u.to_local()), u.device_mesh, u.placements, run_check=False,
                                   shape=u.shape, stride=u.stride()) for u in updates]

    DistributedOrthogonaliser._on_mesh = local_only


def test_parity_catches_orthogonalising_the_local_shard(reference, tmp_path):
    world, argv = LAYOUTS["fsdp2"]
    steps, _ = train(world, MUON + argv, str(tmp_path), setup=_orthogonalise_local_shard_only)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference)


def _orthogonalise_on_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from torchtitan.components.optim.muon import newton_schulz
    from torchtitan.components.optim.muon_distributed import DistributedOrthogonaliser

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    updates, expected = [], []
    for shape in [(24, 40), (25, 39), (3, 5)]:
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        ortho = newton_schulz(g, 5, torch.float32)
        layouts = [(Shard(0), Replicate()), (Replicate(), Shard(1)), (Shard(0), Shard(1)), (Replicate(), Replicate())]
        if shape[0] % 4 == 0:  # distribute_tensor cannot build an uneven strided shard (FSDP pads its own)
            layouts.append((_StridedShard(0, split_factor=2), Shard(0)))
        for placements in layouts:
            updates.append(distribute_tensor(g, mesh, placements))
            expected.append((shape, str(placements), distribute_tensor(ortho, mesh, placements).to_local()))
    got = DistributedOrthogonaliser()(updates, 5, lambda m: newton_schulz(m, 5, torch.float32))
    return [(shape, placements, o.placements == u.placements, torch.equal(o.to_local(), local))
            for (shape, placements, local), o, u in zip(expected, got, updates)]


def _on_mesh(rank, world_size):
    """One 4-rank group for both mesh checks of this file and the chunked loss's (a spawn costs seconds)."""
    from tests.distributed.chunked_loss_parallel import chunked_under_loss_parallel

    return _orthogonalise_on_mesh(rank, world_size), chunked_under_loss_parallel()


@pytest.fixture(scope="module")
def on_mesh():
    return run_ranks(_on_mesh, 4)


def test_orthogonalise_every_placement_equals_one_process(on_mesh):
    for rank_results, _ in on_mesh:
        assert len(rank_results) == 13
        for shape, placements, same_placements, equal in rank_results:
            assert same_placements and equal, (shape, placements)


def test_chunked_loss_under_loss_parallel_equals_one_process(on_mesh):
    from tests.distributed.chunked_loss_parallel import check_against_one_process

    for _, chunked in on_mesh:
        check_against_one_process(*chunked)
