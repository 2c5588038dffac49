"""What a job will train and how: the model, tokenizer and layout, checked before any rank starts work.

`plan_job` is the one judge of whether a job can run. The launcher's pre-flight check (torchtitan/preflight.py)
and the trainer both call it, so both give the same one-line answer, before any process group exists: the
model and flavor, the tokenizer, the layout against the world size, the shapes each parallel degree splits
(declared by the model args' `divisible_by`), a Hugging Face folder to start from (its config against the model,
its weights' shapes against its config), the batch and sequence divisibility, compile, activation
checkpointing, the optimizer settings (Muon), the model converters (Float8), whether the attention kernels the
layout runs compute the kinds the model asks (sliding windows, sinks), the pipeline plan, and every Hugging Face
save the run asks for (a format that cannot hold the trained model fails at the end of the run otherwise).
It also resolves how an MoE model balances its routers (components/moe/args.py resolve_moe_balancing).
"""

import dataclasses
import inspect

import torch
import torch.nn as nn

from torchtitan.components.checkpoint.hf_folder import check_weight_shapes, weight_shapes
from torchtitan.components.moe.args import MoEBalancing, resolve_moe_balancing
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
from torchtitan.eval.runner import build_task_requests
from torchtitan.job_checks import check_job_values
from torchtitan.models.common.attention import check_attention_kernels
from torchtitan.protocols.model_shape import resolve_model
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec
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
    moe_balancing: MoEBalancing | None = None
    """An MoE model's router balancing (the `moe` section's, resolved into model_args.moe) and why, for the
    log; None for a dense model."""


def plan_job(cfg: JobConfig, world_size: int, tokenizer: object | None = None) -> JobPlan:
    """Resolves the model, tokenizer and layout, and checks everything that can fail a job.

    Raises one of torchtitan.errors.USER_ERRORS with one clear line. No process group is needed.
    """
    check_job_values(cfg)
    model_cfg, balancing = _with_moe_balancing(cfg)
    spec, tokenizer, model_args = resolve_model(model_cfg, tokenizer)
    if getattr(model_args, "moe", None) is None:
        balancing = None  # e.g. a dense Qwen3.5
    if cfg.eval.enable:  # task files read, documents turned into windows: bad input is one line here
        build_task_requests(cfg.eval, tokenizer, cfg.training.seq_len)
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
    _check_hf_saves(cfg, spec, model_args, model)
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
                   compile_choice, balancing)


def _with_moe_balancing(cfg: JobConfig) -> tuple[JobConfig, MoEBalancing | None]:
    """`cfg` with its `moe` section's balancing resolved (a copy; the user's config keeps what was set), for
    the model args; unchanged without a `moe` section."""
    if getattr(cfg, "moe", None) is None:
        return cfg, None
    adapter = get_train_spec(cfg.model.name).state_dict_adapter
    balancing = resolve_moe_balancing(cfg, adapter is None or adapter.HF_KEEPS_EXPERT_BIAS)
    moe = dataclasses.replace(cfg.moe, load_balance_coeff=balancing.load_balance_coeff,
                              router_aux_loss_coef=balancing.router_aux_loss_coef)
    return dataclasses.replace(cfg, moe=moe), balancing


def _hf_saves(cfg: JobConfig) -> list[str]:
    """The options of a job that write a Hugging Face folder (hf-step-N) from the trained model."""
    c = cfg.checkpoint
    saves = [f"--checkpoint.last_save {c.last_save}"] if c.enable and c.last_save in ("full_and_hf", "hf_only") else []
    return saves + ([f"--checkpoint.hf_interval {c.hf_interval}"] if c.hf_interval else [])


def _check_hf_saves(cfg: JobConfig, spec: TrainSpec, model_args: object, model: nn.Module) -> None:
    """Every Hugging Face folder the run would write must be writable at its end, judged now instead of
    after the training: the family has an adapter, the format can express the model's args (to_hf_config) and
    name each of its tensors (the adapter's hf_layout of the converted model's state dict, as the save does),
    and a format without a slot for the routers' balancing bias is not asked to hold a moved one
    (--moe.load_balance_coeff > 0 moves it from the first step on)."""
    saves = _hf_saves(cfg)
    if not saves:
        return
    adapter_cls = spec.state_dict_adapter
    if adapter_cls is None:
        raise ValueError(f"{saves[0]} writes a Hugging Face folder, and model {cfg.model.name} has no Hugging Face "
                         f"adapter: keep --checkpoint.last_save full (or full_and_export) and drop hf_interval")
    moe = getattr(model_args, "moe", None)
    if moe is not None and moe.load_balance_coeff > 0 and not adapter_cls.HF_KEEPS_EXPERT_BIAS:
        aux = (" (under pipeline parallel transformers' load-balancing loss cannot run: the routers go unbalanced)"
               if cfg.parallelism.pipeline_parallel_degree > 1
               else f" and --moe.router_aux_loss_coef {moe.router_aux_loss_coef}" if moe.router_aux_loss_coef > 0
               else " and --moe.router_aux_loss_coef 0.001 (transformers' load-balancing loss)")
        raise ValueError(
            f"{saves[0]} writes a Hugging Face {cfg.model.name} folder, whose router has no balancing bias, and "
            f"--moe.load_balance_coeff {moe.load_balance_coeff} moves that bias from the first step (the export "
            f"would fail after training): balance as that format does with --moe.load_balance_coeff 0{aux}, "
            f"or save without hf (--checkpoint.last_save full)"
        )
    try:
        adapter_cls.to_hf_config(model_args)
        adapter = adapter_cls(model_args)
        for key, t in model.state_dict().items():
            adapter.hf_layout(key, t.shape)
    except (ValueError, KeyError, NotImplementedError) as e:
        why = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) quotes its message
        raise ValueError(f"{saves[0]} writes a Hugging Face folder this model does not fit: {why}; keep "
                         f"--checkpoint.last_save full and drop hf_interval") from e


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
