"""Expert parallel changes memory and speed, never the numbers.

The DeepSeek-V3 debug model (MLA, a dense first layer, 3 MoE layers of 8 experts, top-2 of 2 groups, a
shared expert, aux-loss-free balancing on) trains under each layout with the parity protocol of
test_parity_2d (same recipe, seed, data; loss rtol 1e-5, grad norm rtol 5e-5) and must log the same
per-step loss and pre-clipping grad norm as one process. The balancing bias moves after every step from
the loads of the whole step, so the curves also agree only if the loads are summed over exactly the ranks
that routed different tokens. 5 steps keep the file's runtime down.

Expert tensor parallel (TP with EP 1: every expert's hidden units split over the tp ranks, the tokens and
routing gathered over tp, the partial outputs reduce-scattered) is one more layout: TP 2 on 2 ranks, and FSDP 2
on top of it on 4 (the experts' Shard placements on tp composed with FSDP's on dp), for DeepSeek-V3 (a shared
expert, split alike) and, in test_qwen3_moe_matches_single_process, Qwen3-MoE. Its tolerance is the protocol's:
the split only reorders the sums over hidden units (w2's contraction, then the reduce-scatter's sum of 2 partials),
a few fp32 ulps per step like dense TP (measured: loss <= 1.3e-7, grad norm <= 1.2e-5 relative).

The negative control counts the experts' gradients twice (as if the ep ranks were replicas whose
gradients are summed): the model still trains, only a parity check can notice, and it must. (Expert tensor
parallel's control, an output bias added on every tp rank, is in test_gpt_oss_parity.py: GPT-OSS has the bias.)
"""

import pytest

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, train

pytestmark = pytest.mark.distributed

MOE = ["--model.name", "deepseek_v3", "--training.steps", "5"]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# name: (world size, layout arguments)
LAYOUTS = {
    "ep2": (2, EP2 + ["--training.local_batch_size", "4"]),
    "ep2_fsdp2": (4, EP2 + ["--training.local_batch_size", "2"]),
    "ep2_tp2": (4, EP2 + ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "pp2_ep2": (4, EP2 + ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]),
    "cp2_ep2": (2, EP2 + ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "4"]),
    # Expert tensor parallel: EP 1 under TP.
    "tp2": (2, TP2 + ["--training.local_batch_size", "4"]),
    "tp2_fsdp2": (4, TP2 + ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]),
}


def _expert_shards(trainer) -> dict:
    """Routed-expert elements this rank holds (its local shards) and of the whole model, for the parameters
    and for their optimizer state (AdamW's two moments)."""
    from torch.distributed.tensor import DTensor

    from torchtitan.components.moe.experts import GroupedExperts

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).numel()

    state = {p: s for opt in trainer.optimizers.optimizers for p, s in opt.state.items()}
    out = {"params": 0, "full": 0, "state": 0}
    for part in trainer.model_parts:
        for m in part.modules():
            if isinstance(m, GroupedExperts):
                for p in m.parameters():
                    out["params"] += local(p)
                    out["full"] += p.numel()
                    out["state"] += sum(local(v) for v in state[p].values() if v.dim() > 0)
    return out


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
    steps, extras = train(world, MOE + argv, str(tmp_path), probe=_expert_shards)
    assert_parity(curves(steps), reference)
    if layout in ("ep2", "ep2_fsdp2", "tp2", "tp2_fsdp2"):
        # Memory: EP 2 holds half of the routed experts per rank, expert TP 2 half of each expert; FSDP 2 on top
        # halves that again.
        share = 2 if layout in ("ep2", "tp2") else 4
        for e in extras:
            assert e["full"] > 0 and e["params"] * share == e["full"], e
            assert e["state"] == 2 * e["params"], e


def _experts_counted_twice(rank, world_size):
    """Breaks EP on purpose: every routed expert's gradient doubled, as if each ep rank's (already complete)
    expert gradient were summed once more over the ep ranks like a replica's. AdamW's update is nearly
    scale-free, so mainly the global grad norm shows it, the quantity clipping depends on."""
    import torchtitan.components.moe.experts as ex

    real = ex._local

    def doubled(w):
        w = real(w)
        return w + (w - w.detach())  # the same value, twice the gradient

    ex._local = doubled


def test_parity_check_catches_double_counted_experts(reference, tmp_path):
    world, argv = LAYOUTS["ep2"]
    steps, _ = train(world, MOE + argv, str(tmp_path), setup=_experts_counted_twice)
    with pytest.raises(AssertionError):
        assert_parity(curves(steps), reference)


def test_qwen3_moe_matches_single_process(tmp_path):
    """Qwen3-MoE (QK-norm on tp-local heads, softmax routing, no shared expert) under EP 2 x TP 2 (4 ranks) and
    under TP 2 alone (expert tensor parallel)."""
    qwen = ["--model.name", "qwen3_moe", "--training.steps", "5"]
    ref, _ = train(1, qwen + ["--training.local_batch_size", "4"], str(tmp_path / "single"))
    for layout in ("ep2_tp2", "tp2"):
        world, argv = LAYOUTS[layout]
        steps, _ = train(world, qwen + argv, str(tmp_path / layout))
        assert_parity(curves(steps), curves(ref))
