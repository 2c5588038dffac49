"""How DeepSeek-V3 is parallelised: the MoE composition of distributed/expert_parallel.py (CP, TP, EP, AC,
compile, FSDP) with this model's TP plan (MLA heads, dense FFNs; MoE layers on sequence shards)."""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.expert_parallel import moe_tp_plan, parallelize_moe_model
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import apply_cp


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return parallelize_moe_model(model, parallel_dims, job_config, apply_cp=apply_cp, apply_tp=apply_tp)


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Megatron-style TP + sequence parallel for MLA and the dense FFNs; MoE layers run on sequence shards.

    MLA: the query/kv up-projections (wq or wq_b, wkv_b) are column-wise over heads and wo row-wise; the
    down-projections and their norms (wq_a, q_norm, wkv_a, kv_norm) are replicated, their gradients
    complete on every rank because they feed column-wise layers, except the shared rope key, which feeds
    every local head directly: its gradient is summed over tp explicitly. MoE: each tp rank routes its own
    sequence shard (the experts are split over ep, which includes tp); the router gate and the shared
    experts are replicated DTensors, so their gradients are summed over the shards.
    """
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        q_up = "attention.wq" if block.attention.args.q_lora_rank == 0 else "attention.wq_b"
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None),
                use_local_output=True,
            ),
            q_up: ColwiseParallel(),
            "attention.wkv_b": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
        }
        if block.moe_enabled:
            plan.update(moe_tp_plan(block.moe))
        else:
            plan.update({
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            })
        parallelize_module(block, tp_mesh, plan)
        group = tp_mesh.get_group()
        block.attention.shared_key_grad = lambda t, group=group: _AllReduceGrad.apply(t, group)
