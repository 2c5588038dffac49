"""How Llama 3 is parallelised: its tensor-parallel plan, declared; distributed/parallelize.py applies it with
CP, AC, compile and FSDP, to the whole model or to each pipeline stage."""

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed import parallelize as composition
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import COLWISE, ROWWISE, SEQUENCE_PARALLEL, GatherInputs, ParallelPlan
from torchtitan.distributed.parallelize import apply_cp  # noqa: F401  (looked up per call: tests patch it here)

LLAMA3_PLAN = ParallelPlan(
    block_tp={
        "attention_norm": SEQUENCE_PARALLEL,
        "attention": GatherInputs(num_inputs=4),  # x, rope cache, positions, document ids
        "attention.wq": COLWISE,
        "attention.wk": COLWISE,
        "attention.wv": COLWISE,
        "attention.wo": ROWWISE,
        "ffn_norm": SEQUENCE_PARALLEL,
        "feed_forward": GatherInputs(),
        "feed_forward.w1": COLWISE,
        "feed_forward.w2": ROWWISE,
        "feed_forward.w3": COLWISE,
    }
)


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    return composition.parallelize(model, parallel_dims, job_config, LLAMA3_PLAN, cp=apply_cp)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, float8: bool = False) -> None:
    composition.apply_tp(model, tp_mesh, LLAMA3_PLAN, loss_parallel=loss_parallel, float8=float8)
