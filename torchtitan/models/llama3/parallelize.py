"""How a Llama 3 model (or one pipeline stage of it) is parallelised: TP ▸ AC ▸ compile ▸ FSDP.

The whole composition of this model lives in `parallelize_llama`; the appliers it calls are generic.
"""

import torch
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

from torchtitan.components.quantization.float8 import uses_float8_tensor_parallel
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile, check_compile_config, compiles, enable_async_tp
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    pd = parallel_dims
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_compile_config(job_config, device_type)
    compile_model = compiles(job_config, "model")
    if pd.tp_enabled:
        if job_config.parallelism.enable_async_tensor_parallel:
            enable_async_tp(pd.submesh("tp"))
        apply_tp(
            model,
            pd.submesh("tp"),
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            float8=uses_float8_tensor_parallel(job_config, device_type),
        )
    apply_ac(model, job_config.activation_checkpoint, model_compiled=compile_model)
    if compile_model:
        apply_compile(model)
    if pd.fsdp_enabled:
        t = job_config.training
        apply_fsdp(
            model,
            pd.fsdp_mesh(),
            param_dtype=DTYPES[t.mixed_precision_param],
            reduce_dtype=DTYPES[t.mixed_precision_reduce],
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            cpu_offload=t.enable_cpu_offload,
            pp_enabled=pd.pp_enabled,
        )
    return model


def _tp_styles(float8: bool) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) styles; the float8 ones cast to float8 before the collectives, so
    TP all-gathers move float8 bytes (tensorwise float8 only)."""
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, float8: bool = False) -> None:
    """Megatron-style tensor parallel with sequence parallel.

    Between blocks the activations are sharded along the sequence (Shard(1)), so norms run on a sequence
    slice; attention and the FFN all-gather the sequence, split heads / hidden units column-wise, and
    reduce-scatter back to sequence shards through the row-wise output projections. With loss parallel the
    logits stay sharded over the vocabulary and cross entropy runs on shards (no logits all-gather).
    """
    top = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if getattr(model, "norm", None) is not None:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    # The output projection and the embedding keep the plain styles: float8 leaves them in high precision.
    colwise, rowwise, prepare_input = _tp_styles(float8)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": prepare_input(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                "attention.wo": rowwise(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            },
        )
