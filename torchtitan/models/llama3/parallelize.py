"""How a Llama 3 model (or one pipeline stage of it) is parallelised: CP ▸ TP ▸ AC ▸ compile ▸ FSDP.

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
from torchtitan.distributed.context_parallel import ContextParallelAttention, RotateMethod, load_balanced_indices
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.precision import fsdp_dtypes


def parallelize_llama(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    """Parallelises `model` (the whole model or one pipeline stage) in place and returns it.

    CP only swaps attention kernels and sets positions, so its order against TP does not matter; FSDP
    comes last and, with CP on, shards over dp_shard x cp (the cp ranks hold the same parameters).
    """
    pd = parallel_dims
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_compile_config(job_config, device_type)
    compile_model = compiles(job_config, "model")
    if pd.cp_enabled:
        apply_cp(
            model,
            pd.submesh("cp"),
            seq_len=job_config.training.seq_len,
            rotate_method=job_config.parallelism.context_parallel_rotate_method,
        )
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
        param_dtype, reduce_dtype = fsdp_dtypes(t, device_type)
        apply_fsdp(
            model,
            pd.fsdp_mesh(),
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
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
        model.tie_weights()  # the styles registered new Parameters; a tied model shares one again
    # The output projection and the embedding keep the plain styles: float8 leaves them in high precision.
    colwise, rowwise, prepare_input = _tp_styles(float8)
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": prepare_input(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
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


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, seq_len: int, rotate_method: RotateMethod) -> None:
    """Context parallel: this rank sees the load-balanced slice of every sequence (see `shard_batch`).

    Every block's attention becomes ring attention over the cp group, and the model's default positions
    become the global positions of the slice, so RoPE rotates each token by its true position. Under
    TP + sequence parallel the attention input is the TP-all-gathered cp slice, which has exactly these
    positions; the sequence-parallel shards between blocks never index RoPE.
    """
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    for block in model.layers.values():
        block.attention.inner_attention = ContextParallelAttention(cp_mesh.get_group(), rotate_method)
    # A plain attribute, not a buffer: `to_empty` would leave a buffer uninitialised, so it is created
    # directly on this rank's device (the model itself may still be on meta here).
    model.fixed_positions = load_balanced_indices(seq_len, cp_size, cp_rank).to(_rank_device(cp_mesh))


def _rank_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())
