"""Auxiliary-loss-free load balancing (DeepSeek-V3): after each optimizer step every MoE layer's routing
bias moves by `load_balance_coeff` towards balance, from the loads of the whole step.

The loads are summed over every rank that routed different tokens (data parallel, cp and tp shards, ep
ranks: all but the pipeline dimension, whose ranks hold different layers), so every rank applies the same
update and the biases stay identical. A TrainSpec lists `update_expert_bias` in post_optimizer_step_fns.
"""

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.components.moe.moe import MoE


@torch.no_grad()
def update_expert_bias(model_parts: list[nn.Module], parallel_dims) -> None:
    moes = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
    if not moes:
        return
    balancing = [m for m in moes if m.args.load_balance_coeff > 0]
    if balancing:
        loads = torch.stack([m.tokens_per_expert for m in balancing])
        group = parallel_dims.submesh("batch") if parallel_dims.world_size > 1 else None
        if group is not None:
            dist.all_reduce(loads, group=group.get_group())
        for m, load in zip(balancing, loads):
            delta = m.args.load_balance_coeff * torch.sign(load.mean() - load)
            # Only differences between biases change the routing; centring keeps them from drifting.
            m.expert_bias.add_(delta - delta.mean())
    for m in moes:
        m.tokens_per_expert.zero_()
