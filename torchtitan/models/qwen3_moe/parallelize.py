"""How Qwen3-MoE is parallelised: the MoE composition of distributed/expert_parallel.py with Qwen3's
attention TP plan (heads column-wise, QK-norm on local heads) and MoE layers on sequence shards."""

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
from torchtitan.models.qwen3.parallelize import apply_cp


def parallelize_qwen3_moe(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return parallelize_moe_model(model, parallel_dims, job_config, apply_cp=apply_cp, apply_tp=apply_tp)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
    """Sequence-parallel TP: Qwen3's attention plan (see models/qwen3/parallelize.py) and moe_tp_plan."""
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
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            **moe_tp_plan(block.moe),
        }
        parallelize_module(block, tp_mesh, plan)
