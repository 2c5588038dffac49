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

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.pipeline import pipeline_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    pd = parallel_dims
    if pd.tp_enabled:
        apply_tp(model, pd.submesh("tp"), loss_parallel=not job_config.parallelism.disable_loss_parallel)
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


def pipeline_llama(model, parallel_dims, job_config, device, model_args, loss_fn):
    """Pipeline stages of a Llama 3 model, each parallelised like a whole model by parallelize_llama
    (so PP x TP x FSDP is one composition). The embedding leads, the final norm and output close."""
    return pipeline_model(
        model,
        parallel_dims,
        job_config,
        device,
        loss_fn,
        parallelize_fn=parallelize_llama,
        head=("tok_embeddings",),
        tail=("norm", "output"),
    )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool) -> None:
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
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
