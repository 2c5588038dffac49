"""Balanced pipeline stages: exact against brute force, better than the even split on a large vocabulary."""

import dataclasses
import itertools
import random

import pytest
import torch

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.distributed.pipeline import module_order, plan_pipeline
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.distributed.balance import InfeasibleSplit, balanced_split, bottleneck, module_flops


def brute_force(costs, k, memory, limit):
    """Smallest bottleneck over every contiguous split into k non-empty stages that fits `limit`."""
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        if any(sum(memory[a:b]) > limit for a, b in zip(bounds, bounds[1:])):
            continue
        b = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = b if best is None else min(best, b)
    return best


def test_optimal_against_brute_force_on_random_instances():
    rng = random.Random(0)
    checked_infeasible = 0
    for _ in range(300):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        costs = [rng.randint(0, 20) for _ in range(n)]
        memory = [rng.randint(1, 10) for _ in range(n)]
        limit = rng.randint(5, 40)
        expected = brute_force(costs, k, memory, limit) if n >= k else None
        if expected is None:
            checked_infeasible += 1
            with pytest.raises(InfeasibleSplit):
                balanced_split(costs, k, memory, limit)
            continue
        sizes = balanced_split(costs, k, memory, limit)
        assert len(sizes) == k and min(sizes) >= 1 and sum(sizes) == n
        starts = [sum(sizes[:i]) for i in range(k)]
        assert all(sum(memory[a : a + s]) <= limit for a, s in zip(starts, sizes))
        assert bottleneck(costs, sizes) == expected
    assert checked_infeasible > 10  # the random limits also produce instances nothing fits


def eight_layer_8b():
    args = dataclasses.replace(llama3_flavors["8B"], n_layers=8, max_seq_len=8192)
    with torch.device("meta"):
        model = Transformer(args)
    order = module_order(model, ("tok_embeddings",), ("norm", "output"))
    attention = args.flops_per_token(0, 8192) / args.n_layers
    return order, module_flops(model, order, attention)


def test_large_vocabulary_balanced_split_beats_the_even_split():
    order, costs = eight_layer_8b()
    p = Parallelism(pipeline_parallel_degree=2)
    even = plan_pipeline(p, order, 1, 2, 2)
    balanced = plan_pipeline(dataclasses.replace(p, pipeline_parallel_split="balanced"), order, 1, 2, 2, costs)
    sizes = lambda plan: [len(s) for s in plan.stages]  # noqa: E731
    # The output projection (4096 x 128256) costs ~1.8 blocks, so the balanced cut gives the first stage a block more.
    assert sizes(even) == [5, 6] and sizes(balanced) == [6, 5]
    assert bottleneck(costs, sizes(balanced)) == brute_force(costs, 2, [0] * len(costs), 1)
    assert bottleneck(costs, sizes(even)) / bottleneck(costs, sizes(balanced)) > 1.1


def test_balanced_split_needs_costs_and_enough_modules():
    order, costs = eight_layer_8b()
    p = Parallelism(pipeline_parallel_degree=8, pipeline_parallel_split="balanced",
                    pipeline_parallel_schedule="Interleaved1F1B")
    with pytest.raises(LayoutError, match="11 modules cannot fill 16 stages"):
        plan_pipeline(p, order, 1, 2, 16, costs)
    with pytest.raises(ValueError, match="one cost per module"):
        plan_pipeline(dataclasses.replace(p, pipeline_parallel_degree=2), order, 1, 2, 16)


def test_a_moe_block_weighs_its_active_experts_only():
    """A token passes through top_k routed experts (stacked parameters, not nn.Linear) plus the router and
    the shared experts: the balanced split weighs MoE blocks by that, not by zero routed FLOPs nor by all
    experts."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, deepseek_v3_flavors

    args = deepseek_v3_flavors["debugmodel"]
    with torch.device("meta"):
        model = DeepSeekV3Model(args)
    dense, moe = model.layers["0"], model.layers["1"]
    flops = module_flops(model, ["layers.0", "layers.1"], 0.0)
    attention = sum(m.weight.numel() for m in moe.attention.modules() if isinstance(m, torch.nn.Linear))
    m = args.moe
    one_expert = 3 * args.dim * m.hidden_dim
    by_hand = attention + args.dim * m.num_experts + m.num_shared_experts * one_expert + m.top_k * one_expert
    assert flops[1] == 6 * by_hand
    assert flops[0] == 6 * sum(p.numel() for n, p in dense.named_parameters() if n.endswith(".weight") and p.dim() == 2)
