"""Balanced pipeline stages: cut a sequence of modules into contiguous stages so the slowest stage is as
fast as possible, with every stage under a memory limit.

The cut is exact: a dynamic program over (modules placed, stages used) keeps, for every prefix, the
smallest achievable bottleneck; O(stages x modules^2), a few milliseconds for the 128 modules of a 405B
model. Costs are anything additive per module (FLOPs from `module_flops`, or times measured on the
device at hand); memory is additive per module too (bytes of parameters, gradients, optimizer state and
activations).
"""

from collections.abc import Sequence

import torch.nn as nn


class InfeasibleSplit(ValueError):
    """No contiguous split into the asked number of stages fits the memory limit."""


def balanced_split(
    costs: Sequence[float],
    num_stages: int,
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
) -> list[int]:
    """Module counts per stage (contiguous, each >= 1) minimising the largest stage cost, subject to each
    stage's summed `memory` <= `memory_limit`. Among optimal splits, the one found first by the DP (the
    earliest cut points) is returned, so results are deterministic."""
    n = len(costs)
    if num_stages < 1 or n < num_stages:
        raise InfeasibleSplit(f"{n} modules cannot fill {num_stages} stages (each stage needs at least one)")
    mem = list(memory) if memory is not None else [0.0] * n
    limit = float("inf") if memory_limit is None else memory_limit
    pc, pm = [0.0], [0.0]
    for c, m in zip(costs, mem):
        pc.append(pc[-1] + c)
        pm.append(pm[-1] + m)
    inf = float("inf")
    # best[j][i]: smallest bottleneck placing the first i modules on j stages; cut[j][i]: where stage j starts.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for i in range(j, n - (num_stages - j) + 1):
            for s in range(j - 1, i):
                if best[j - 1][s] == inf or pm[i] - pm[s] > limit:
                    continue
                b = max(best[j - 1][s], pc[i] - pc[s])
                if b < best[j][i]:
                    best[j][i], cut[j][i] = b, s
    if best[num_stages][n] == inf:
        raise InfeasibleSplit(
            f"no split of {n} modules into {num_stages} stages keeps every stage under the memory limit "
            f"({limit:.3g}); use more stages or a layout with less memory per stage"
        )
    sizes, i = [], n
    for j in range(num_stages, 0, -1):
        sizes.append(i - cut[j][i])
        i = cut[j][i]
    return sizes[::-1]


def bottleneck(costs: Sequence[float], sizes: Sequence[int]) -> float:
    """The largest stage cost of a split given as module counts per stage."""
    out, start = 0.0, 0
    for size in sizes:
        out = max(out, sum(costs[start : start + size]))
        start += size
    return out


def module_flops(model: nn.Module, order: Sequence[str], attention_flops_per_token_per_block: float) -> list[float]:
    """Training FLOPs per token (forward + backward) of each module named in `order`: 6 per weight of every
    nn.Linear inside it (2 forward, 4 backward), plus `attention_flops_per_token_per_block` for each block
    of `layers` (score and value matmuls, which have no weights). A submodule that defines
    `active_params_per_token()` (a mixture of experts: only top_k experts see a token) counts that instead of
    its linears. Embedding lookups and norms cost ~0 FLOPs; the output projection, with a large vocabulary,
    costs more than a block."""
    out = []
    for name in order:
        flops = 6.0 * _active_params(model.get_submodule(name))
        if name.startswith("layers."):
            flops += attention_flops_per_token_per_block
        out.append(flops)
    return out


def _active_params(module: nn.Module) -> int:
    """Weights a token multiplies inside `module`: its own count where it declares one, else its nn.Linear
    weights, recursively."""
    if hasattr(module, "active_params_per_token"):
        return module.active_params_per_token()
    if isinstance(module, nn.Linear):
        return module.weight.numel()
    return sum(_active_params(child) for child in module.children())
