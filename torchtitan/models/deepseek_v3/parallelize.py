"""How DeepSeek-V3 is parallelised: CP, TP (MLA heads, dense FFNs; MoE on sequence shards), EP, AC,
compile, then FSDP with the routed experts as their own groups. Only the TP plan is model-specific."""

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
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.compile import apply_compile, check_compile_config, compiles
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.expert_parallel import apply_ep
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.models.llama3.parallelize import apply_cp
from torchtitan.tools.precision import DTYPES


def parallelize_deepseek_v3(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
    pd = parallel_dims
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_compile_config(job_config, device_type)
    compile_model = compiles(job_config, "model")
    if pd.cp_enabled:
        apply_cp(model, pd.submesh("cp"), seq_len=job_config.training.seq_len,
                 rotate_method=job_config.parallelism.context_parallel_rotate_method)
    if pd.tp_enabled:
        apply_tp(model, pd.submesh("tp"), loss_parallel=not job_config.parallelism.disable_loss_parallel)
    experts = apply_ep(model, pd.submesh("ep")) if pd.ep_enabled else []
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
            expert_modules=experts,
            expert_mesh=pd.expert_fsdp_mesh() if experts else None,
        )
    return model


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
            plan["moe"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
            )
            plan["moe.router.gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
            if block.moe.shared_experts is not None:
                for w in ("w1", "w2", "w3"):
                    plan[f"moe.shared_experts.{w}"] = SequenceParallel(sequence_dim=1, use_local_output=True)
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
