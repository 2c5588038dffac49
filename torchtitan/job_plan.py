"""What a job will train and how: the model, tokenizer and layout, checked before any rank starts work.

`plan_job` is the one judge of whether a job can run. The launcher's pre-flight check (torchtitan/preflight.py)
and the trainer both call it, so both give the same one-line answer, before any process group exists: the
model and flavor, the tokenizer, the layout against the world size, the shapes each parallel degree splits
(declared by the model args' `divisible_by`), a Hugging Face folder to start from (its config against the model,
its weights' shapes against its config), the batch and sequence divisibility, compile, activation
checkpointing, the optimizer settings (Muon), the model converters (Float8), whether the attention kernels the
layout runs compute the kinds the model asks (sliding windows, sinks) and the pipeline plan.
"""

import dataclasses
import inspect

import torch
import torch.nn as nn

from torchtitan.components.checkpoint.hf_folder import check_weight_shapes, weight_shapes
from torchtitan.components.optim.muon import check_muon_config
from torchtitan.components.quantization import ModelConverters, build_model_converters
from torchtitan.config import JobConfig
from torchtitan.components.optim.optimizer_offload import check_optimizer_offload
from torchtitan.distributed.activation_checkpoint import check_ac_config, check_block_choices
from torchtitan.distributed.compile import check_compile_config, compiles
from torchtitan.distributed.compile_auto import CompileChoice, resolve_compile_auto
from torchtitan.distributed.context_parallel import ContextParallelAttention
from torchtitan.distributed.context_parallel_a2a import check_cp_method
from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims, parallel_dims_from_config
from torchtitan.distributed.parallel_dims import device_type as parallel_dims_device_type
from torchtitan.distributed.pipeline import PipelinePlan, plan_model_pipeline
from torchtitan.job_checks import check_job_values
from torchtitan.models.common.attention import check_attention_kernels
from torchtitan.protocols.model_shape import resolve_model
from torchtitan.protocols.train_spec import TrainSpec
from torchtitan.tools import storage
from torchtitan.tools.precision import Precision, resolve_precision


@dataclasses.dataclass
class JobPlan:
    """What a job will train and how, checked before any rank starts work."""

    spec: TrainSpec
    tokenizer: object
    model_args: object
    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum: int
    model: nn.Module
    """The whole model on the meta device, cast to training.dtype and converted (e.g. Float8)."""
    converters: ModelConverters
    pipeline_plan: PipelinePlan | None
    precision: Precision
    """The dtypes the job trains in on its device ("auto" resolved)."""
    compile_choice: CompileChoice
    """Whether the blocks compile (`compile.auto` resolved into cfg.compile) and why, for the log."""


def plan_job(cfg: JobConfig, world_size: int, tokenizer: object | None = None) -> JobPlan:
    """Resolves the model, tokenizer and layout, and checks everything that can fail a job.

    Raises one of torchtitan.errors.USER_ERRORS with one clear line. No process group is needed.
    """
    check_job_values(cfg)
    spec, tokenizer, model_args = resolve_model(cfg, tokenizer)
    pd = parallel_dims_from_config(cfg.parallelism, world_size)
    pd.check_model(model_args.divisible_by())
    par = cfg.parallelism
    check_cp_method(par.context_parallel_method, par.context_parallel_a2a_degree, pd.cp, pd.tp,
                    model_args.divisible_by().get("tp", {}).get("n_heads"))
    t = cfg.training
    global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * pd.dp
    accum = pd.check_batch(seq_len=t.seq_len, global_batch_size=global_bs, local_batch_size=t.local_batch_size)
    device_type = parallel_dims_device_type()
    _check_device_features(cfg, device_type)
    # The device the ranks will train on decides "auto" precision.
    precision = resolve_precision(t.dtype, t.mixed_precision_param, torch.device(device_type))
    check_compile_config(cfg, device_type)
    check_ac_config(cfg.activation_checkpoint, model_compiled=compiles(cfg, "model"))
    check_muon_config(cfg.optimizer)

    with torch.device("meta"):
        model = spec.model_cls(model_args)
    _check_hf_initial_load(cfg, spec, model_args, model)
    # Cast on meta: init_weights then rebuilds derived fp32 buffers (e.g. the RoPE table) at full precision.
    model.to(precision.param)
    converters = build_model_converters(cfg, pd, torch.device(device_type))
    converters.convert(model)
    _check_model_inputs(cfg, model)
    # After the explicit compile checks above: auto only turns compile on where they would pass.
    compile_choice = resolve_compile_auto(cfg, model, model_args, pd, device_type, world_size,
                                          converters.matmul_dtype(precision.matmul))
    check_block_choices(cfg.memory, cfg.activation_checkpoint, len(model.layers))
    check_optimizer_offload(cfg, device_type)
    # The kernel each attention will run: ring and hierarchical context parallel swap in ring attention;
    # Ulysses runs the model's own kernel over whole sequences.
    ring_cp = pd.cp_enabled and cfg.parallelism.context_parallel_method != "ulysses"
    check_attention_kernels(model, ContextParallelAttention if ring_cp else None,
                            " (context parallel)" if ring_cp else "")

    pipeline_plan = None
    if pd.pp_enabled:
        if spec.pipelining_fn is None:
            raise LayoutError(f"model {cfg.model.name} does not support pipeline parallel")
        pipeline_plan = plan_model_pipeline(model, pd, cfg)
    return JobPlan(spec, tokenizer, model_args, pd, global_bs, accum, model, converters, pipeline_plan, precision,
                   compile_choice)


def _check_hf_initial_load(cfg: JobConfig, spec: TrainSpec, model_args: object, model: nn.Module) -> None:
    """A Hugging Face folder to start from (--checkpoint.initial_load_in_hf), judged from its config.json and
    its safetensors headers, before any rank reads a byte of it: complete files, a config describing the model
    the job trains, and weights of the shapes that config implies."""
    path = cfg.checkpoint.initial_load_path
    if not (cfg.checkpoint.initial_load_in_hf and path and storage.isdir(path)):
        return
    have = weight_shapes(path)  # a truncated file or an index naming a missing one: one line, now
    adapter = spec.state_dict_adapter
    if adapter is None or not storage.isfile(storage.join(path, "config.json")):
        return  # the checkpoint manager refuses these in one line
    adapter.check_hf_config(path, adapter.args_from_hf(path), model_args)
    check_weight_shapes(path, adapter(model_args), {k: v.shape for k, v in model.state_dict().items()}, have)


def _check_device_features(cfg: JobConfig, device_type: str) -> None:
    """Options that only exist on CUDA devices are refused up front on a machine without one."""
    if device_type == "cuda":
        return
    if cfg.training.enable_cpu_offload:
        raise ValueError("--training.enable_cpu_offload moves GPU memory to the host: it needs CUDA devices")
    if cfg.profiling.enable_memory_snapshot:
        raise ValueError("--profiling.enable_memory_snapshot records the CUDA caching allocator: it needs CUDA devices")


def _check_model_inputs(cfg: JobConfig, model: nn.Module) -> None:
    """Batch inputs beyond tokens that the data options add must be keyword inputs of the model's forward."""
    t = cfg.training
    wanted = {"document_ids": "--training.document_masking", "positions": "--training.document_positions"}
    asked = [name for name, flag in wanted.items() if getattr(t, flag.rsplit(".", 1)[1])]
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    missing = [name for name in asked if name not in params and not takes_any]
    if missing:
        raise ValueError(
            f"{wanted[missing[0]]} feeds `{missing[0]}` to the model, but model {cfg.model.name!r} does not take "
            f"that input (its forward has no `{missing[0]}` parameter); turn the option off or use a model that "
            f"supports it (e.g. llama3)"
        )
