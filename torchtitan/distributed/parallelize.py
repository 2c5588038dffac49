"""The one composition of the parallelisms, used by every model family: CP ▸ TP ▸ EP ▸ AC ▸ compile ▸ FSDP.

A family declares its tensor-parallel plan as data (`ParallelPlan`): which module of a transformer block gets
which TP style. `parallelize(model, parallel_dims, job_config, plan)` applies, to the whole model or to one
pipeline stage (distributed.pipeline cuts the model first and calls the family's parallelize_fn per stage):

  CP       every attention kernel (a block's submodule named `inner_attention`) becomes ring attention over
           the cp ranks, or the Ulysses / hierarchical all-to-all around it (parallelism.context_parallel_method),
           and the model's `fixed_positions` the global positions of this rank's slice.
  TP       the model-level plan every family shares (embedding row-wise, final norm sequence-parallel, output
           column-wise with loss parallel) and the family's block plan; float8 styles where Float8 TP is on,
           async TP where configured. Between blocks activations are sequence shards (Shard(1)).
  EP       every MoE layer's routed experts split over the ep ranks (distributed.expert_parallel.apply_ep); with
           EP 1 under TP, every expert's hidden units split over the tp ranks instead (expert tensor parallel,
           applied with the TP plan's MOE entries: distributed.expert_parallel.moe_tp_plan).
  AC       per block (distributed.activation_checkpoint; or keep/op/full/offload/full_offload per block from
           --memory.block_choices), then compile per block, then FSDP: blocks,
           embedding, norm + output, and the routed experts as their own groups over the expert mesh.

CP only swaps attention kernels and sets positions, so its order against TP does not matter; FSDP comes last
and, with CP on, shards over dp_shard x cp (the cp ranks hold the same parameters). A tied embedding/output
stays one parameter: TP shards both alike (Shard(0) of the [vocab, dim] matrix) and the model's `tie_weights`
re-ties them; apply_fsdp puts the two modules in one group.

The block plan is data: module names inside a block -> a style name (COLWISE, ROWWISE, SEQUENCE_PARALLEL,
HEAD_NORM, HEAD_PARAMS, MOE) or a `GatherInputs` entry. An entry applies to every block that has the module, so
one plan covers block kinds (dense and MoE blocks, MLA with or without a compressed query); a misspelt entry leaves
weights replicated, which the dry run's per-rank bytes show (tests/unit/test_dry_run_shards_unchanged.py).
`tp_grad_sums` names activation hooks whose
gradient must be summed over tp, e.g. MLA's rope key shared by every local head. `extra` is the escape hatch
for a model that needs code after TP.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from torchtitan.components.quantization.float8 import uses_float8_tensor_parallel
from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import apply_ac, apply_block_choices
from torchtitan.distributed.compile import apply_compile, check_compile_config, compiles, enable_async_tp
from torchtitan.distributed.context_parallel import RotateMethod, load_balanced_indices
from torchtitan.distributed.context_parallel_a2a import CPMethod, cp_attention_factory
from torchtitan.distributed.data_parallel import apply_fsdp
from torchtitan.distributed.expert_parallel import apply_ep, moe_tp_plan
from torchtitan.distributed.linear_attention_cp import StatePassingLinearAttention
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.precision import fsdp_dtypes

COLWISE = "colwise"
"""Column-wise: the output features (heads, hidden units) split over tp; the input is the whole sequence."""
ROWWISE = "rowwise"
"""Row-wise: the input features split over tp; the output reduce-scattered back to sequence shards."""
SEQUENCE_PARALLEL = "sequence_parallel"
"""A norm between blocks: runs on this rank's sequence shard, its replicated weight's gradient summed over tp."""
HEAD_NORM = "head_norm"
"""A norm over each local head ([B, S, heads, head_dim] read as sharded on the heads, dim 2), e.g. QK-norm:
its replicated weight's gradient, a sum over every head, is summed over tp."""
MOE = "moe"
"""An MoE layer: each tp rank routes its own sequence shard; the routed and shared experts are split over ep (which
includes tp), or with EP 1 over tp by their hidden units (expert tensor parallel; distributed.expert_parallel.
moe_tp_plan)."""
HEAD_PARAMS = "head_params"
"""A module whose parameters hold one entry per attention head (or head channel) on dim 0 (attention sinks,
Gated DeltaNet's conv and decay): sharded over tp like the heads of the column-wise projections feeding it, so
each rank holds and computes with its own heads' entries (their gradient stays on its rank: nothing to reduce)."""


class _ShardHeadParams(ParallelStyle):
    """HEAD_PARAMS: the module's own parameters become DTensors sharded on dim 0; the module reads its local
    shard (models/common/attention.py's AttentionSinks), whose gradient stays on its rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, device_mesh, [Shard(0)])))
        return module


@dataclass(frozen=True)
class GatherInputs:
    """A module whose first input arrives as sequence shards and is all-gathered to the whole sequence (the
    attention and FFN inputs); `num_inputs` positional inputs in all, the others passed through."""

    num_inputs: int = 1
    local_output: bool = False
    """Hand the module plain tensors instead of DTensors (for a module whose replicated linears read them)."""


Style = str | GatherInputs


@dataclass(frozen=True)
class ParallelPlan:
    """How a family's blocks are tensor-parallelised; the rest of the composition is the framework's."""

    block_tp: Mapping[str, Style]
    """Module name inside a block (as `block.get_submodule` reads it) -> its TP style, applied in every block
    that has the module."""
    tp_grad_sums: tuple[str, ...] = ()
    """Attributes of a block's submodules (dotted, e.g. "attention.shared_key_grad") that the model calls on an
    activation, set under TP to the identity whose backward all-reduces the gradient over tp."""
    extra: Callable[[nn.Module, ParallelDims, JobConfig], None] | None = field(default=None, compare=False)
    """Escape hatch: code run after TP and before EP, for what the styles cannot say."""


class _SumGradOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _styles(float8: bool) -> tuple[type, type, type]:
    """(colwise, rowwise, prepare-input) classes; the float8 ones cast to float8 before the collectives, so TP
    all-gathers move float8 bytes (tensorwise float8 only)."""
    if float8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def _has(module: nn.Module, name: str) -> bool:
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def block_tp_plan(block: nn.Module, plan: ParallelPlan, *, float8: bool = False,
                  experts_over_tp: bool = True) -> dict:
    """The torch `parallelize_module` plan of one block: the entries of `plan.block_tp` it has, as styles.
    experts_over_tp: MoE layers split their experts over tp (expert tensor parallel, EP 1)."""
    colwise, rowwise, prepare_input = _styles(float8)
    out: dict = {}
    for name, style in plan.block_tp.items():
        if not _has(block, name):
            continue
        if isinstance(style, GatherInputs):
            rest = (None,) * (style.num_inputs - 1)
            kwargs = {"use_local_output": True} if style.local_output else {}
            out[name] = prepare_input(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest),
                                      **kwargs)
        elif style == COLWISE:
            out[name] = colwise()
        elif style == ROWWISE:
            out[name] = rowwise(output_layouts=Shard(1))
        elif style == SEQUENCE_PARALLEL:
            out[name] = SequenceParallel()
        elif style == HEAD_NORM:
            out[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif style == HEAD_PARAMS:
            out[name] = _ShardHeadParams()
        elif style == MOE:
            out.update(moe_tp_plan(block.get_submodule(name), name, experts_over_tp=experts_over_tp))
        else:
            raise ValueError(f"TP plan entry {name!r}: unknown style {style!r}")
    return out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: ParallelPlan, *, loss_parallel: bool,
             float8: bool = False, experts_over_tp: bool = True) -> None:
    """Megatron-style tensor parallel with sequence parallel: the shared model-level plan, then `plan` per block.
    MoE layers split their experts over tp (expert tensor parallel) unless `experts_over_tp` is False (expert
    parallel is on and splits them over ep, which includes tp).

    With loss parallel the logits stay sharded over the vocabulary and cross entropy runs on shards (no logits
    all-gather). The embedding and the output projection keep the plain styles: float8 leaves them in high
    precision."""
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
        if hasattr(model, "tie_weights"):
            model.tie_weights()  # each style registered a new Parameter
    group = tp_mesh.get_group()
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_tp_plan(block, plan, float8=float8, experts_over_tp=experts_over_tp))
        for path in plan.tp_grad_sums:
            owner_name, _, attr = path.rpartition(".")
            if _has(block, owner_name):
                setattr(block.get_submodule(owner_name), attr, lambda t, g=group: _SumGradOverGroup.apply(t, g))


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, seq_len: int, rotate_method: RotateMethod,
             method: CPMethod = "ring", a2a_degree: int = 0) -> None:
    """Context parallel: this rank sees the load-balanced slice of every sequence (see `shard_batch`).

    Every block's attention kernel (`inner_attention`) becomes its context-parallel form over the cp group,
    chosen here by the kernel's kind and the configured `method`: state passing for linear attention (a
    recurrent state crosses the sequence, whatever the method), and for softmax attention ring attention or
    the all-to-all of distributed.context_parallel_a2a around the kernel itself; and the
    model's default positions become the global positions of the slice, so RoPE rotates each token by its true
    position. Under TP + sequence parallel the attention input is the TP-all-gathered cp slice, which has
    exactly these positions; the sequence-parallel shards between blocks never index RoPE."""
    cp_rank, cp_size = cp_mesh.get_local_rank(), cp_mesh.size()
    cp_kernel = cp_attention_factory(cp_mesh, method, a2a_degree, rotate_method)
    for block in model.layers.values():
        kernels = [name for name, _ in block.named_modules() if name.rpartition(".")[2] == "inner_attention"]
        if not kernels:
            raise ValueError(f"context parallel: a block of {type(model).__name__} has no `inner_attention` kernel")
        for name in kernels:
            owner_name = name.rpartition(".")[0]
            owner = block.get_submodule(owner_name) if owner_name else block
            kernel = owner.inner_attention
            if getattr(kernel, "kind", None) == "linear_attention":
                owner.inner_attention = StatePassingLinearAttention(cp_mesh.get_group(), kernel)
            else:
                owner.inner_attention = cp_kernel(kernel)
    # A plain attribute, not a buffer: `to_empty` would leave a buffer uninitialised, so it is created directly
    # on this rank's device (the model itself may still be on meta here).
    model.fixed_positions = load_balanced_indices(seq_len, cp_size, cp_rank).to(_rank_device(cp_mesh))


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _rank_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def parallelize(
    model: nn.Module,
    parallel_dims: ParallelDims,
    job_config: JobConfig,
    plan: ParallelPlan,
    *,
    cp: Callable[..., None] = apply_cp,
) -> nn.Module:
    """Parallelises `model` (the whole model or one pipeline stage) in place by `plan` and returns it.
    `cp` is the context-parallel applier (apply_cp; a family module passes its own name for it so a test can
    break CP in that family on purpose)."""
    pd = parallel_dims
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_compile_config(job_config, device_type)
    compile_model = compiles(job_config, "model")
    if pd.cp_enabled:
        cp(model, pd.submesh("cp"), seq_len=job_config.training.seq_len,
           rotate_method=job_config.parallelism.context_parallel_rotate_method,
           method=job_config.parallelism.context_parallel_method,
           a2a_degree=job_config.parallelism.context_parallel_a2a_degree)
    if pd.tp_enabled:
        if job_config.parallelism.enable_async_tensor_parallel:
            enable_async_tp(pd.submesh("tp"))
        apply_tp(model, pd.submesh("tp"), plan, loss_parallel=not job_config.parallelism.disable_loss_parallel,
                 float8=uses_float8_tensor_parallel(job_config, device_type), experts_over_tp=not pd.ep_enabled)
    if plan.extra is not None:
        plan.extra(model, pd, job_config)
    experts = apply_ep(model, pd.submesh("ep")) if pd.ep_enabled else []
    apply_ac(model, job_config.activation_checkpoint, model_compiled=compile_model)
    mem = job_config.memory
    apply_block_choices(model, mem.block_choices, _device(device_type), mem.offload_dir, mem.offload_prefetch)
    if compile_model:
        # Compiled around what cannot sit in a block's graph: the CP attention kernels, and experts that FSDP
        # shards apart from their block (their own group over dp_shard_mod_ep).
        kernels = [m for b in model.layers.values() for n, m in b.named_modules()
                   if pd.cp_enabled and n.rpartition(".")[2] == "inner_attention"]
        apart = experts if pd.fsdp_enabled and experts and pd.expert_fsdp_mesh() is not None else []
        apply_compile(model, eager=kernels, apart=apart, backend=job_config.compile.backend)
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
            expert_modules=experts,
            expert_mesh=pd.expert_fsdp_mesh() if experts else None,
        )
    return model


def parallelizer(plan: ParallelPlan) -> Callable[[nn.Module, ParallelDims, JobConfig], nn.Module]:
    """A TrainSpec's parallelize_fn for a family whose plan is all it declares."""

    def parallelize_fn(model: nn.Module, parallel_dims: ParallelDims, job_config: JobConfig) -> nn.Module:
        return parallelize(model, parallel_dims, job_config, plan)

    return parallelize_fn
