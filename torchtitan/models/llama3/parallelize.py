"""How Llama 3 is parallelised: its tensor-parallel plan, declared; distributed/parallelize.py applies it with
CP, AC, compile and FSDP, to the whole model or to each pipeline stage."""

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import parallelize as composition
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import ParallelPlan
from torchtitan.distributed.parallelize import apply_cp  # noqa: F401  (looked up per call: tests patch it here)
from torchtitan.models.common.tp_plans import SWIGLU_FFN, gqa_attention

# attention(x, rope cache, positions, document ids)
LLAMA3_PLAN = ParallelPlan(block_tp={**gqa_attention(num_inputs=4), **SWIGLU_FFN})


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return composition.parallelize(model, parallel_dims, job_config, LLAMA3_PLAN, cp=apply_cp)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, float8: bool = False) -> None:
    composition.apply_tp(model, tp_mesh, LLAMA3_PLAN, loss_parallel=loss_parallel, float8=float8)
