"""What a job will train and how: the model, tokenizer and layout, checked before any rank starts work.

`plan_job` is the one judge of whether a job can run; the launcher's pre-flight check and the trainer both
call it, so both give the same one-line answer.
"""

import dataclasses

import torch

from torchtitan.config import JobConfig
from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims, parallel_dims_from_config
from torchtitan.job_checks import check_job_values
from torchtitan.tools.precision import Precision, resolve_precision
from torchtitan.train_spec import TrainSpec, get_flavor, get_train_spec


@dataclasses.dataclass
class JobPlan:
    """What a job will train and how, checked before any rank starts work."""

    spec: TrainSpec
    tokenizer: object
    model_args: object
    parallel_dims: ParallelDims
    global_batch_size: int
    grad_accum: int
    precision: Precision


def resolve_model(cfg: JobConfig) -> tuple[TrainSpec, object, object]:
    """(train spec, tokenizer, model args) of a job: the flavor's shape, with the vocabulary of the tokenizer
    in use and room for the recipe's seq_len. Also used offline (conversion, generation) from a checkpoint's
    saved config, so a model is rebuilt with exactly the shape it was trained with."""
    spec = get_train_spec(cfg.model.name)
    flavor = get_flavor(spec, cfg.model.flavor)
    tokenizer = spec.build_tokenizer_fn(cfg)
    model_args = dataclasses.replace(
        flavor, vocab_size=tokenizer.vocab_size, max_seq_len=max(flavor.max_seq_len, cfg.training.seq_len)
    )
    return spec, tokenizer, model_args


def plan_job(cfg: JobConfig, world_size: int) -> JobPlan:
    """Resolves the model, tokenizer and layout, and checks they fit together.

    Raises ValueError / LayoutError / FileNotFoundError with one clear line. Used by the trainer and by
    the launcher's pre-flight check, so both judge a job the same way.
    """
    check_job_values(cfg)
    spec, tokenizer, model_args = resolve_model(cfg)
    pd = parallel_dims_from_config(cfg.parallelism, world_size)
    # Shape fields a model may not have (a toy model without attention) are simply not checked.
    pd.check_model({k: getattr(model_args, k) for k in ("n_heads", "n_kv_heads", "dim", "vocab_size") if getattr(model_args, k, None)})
    t = cfg.training
    global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * pd.dp
    accum = pd.check_batch(seq_len=t.seq_len, global_batch_size=global_bs, local_batch_size=t.local_batch_size)
    if pd.pp_enabled and spec.pipelining_fn is None:
        raise LayoutError(f"model {cfg.model.name} does not support pipeline parallel")
    _check_device_features(cfg)
    # The device the ranks will train on (as dist_utils.init_distributed picks it) decides "auto" precision.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = resolve_precision(t.dtype, t.mixed_precision_param, device)
    return JobPlan(spec, tokenizer, model_args, pd, global_bs, accum, precision)


def _check_device_features(cfg: JobConfig) -> None:
    """Options that only exist on CUDA devices are refused up front on a machine without one."""
    if torch.cuda.is_available():
        return
    if cfg.training.enable_cpu_offload:
        raise ValueError("--training.enable_cpu_offload moves GPU memory to the host: it needs CUDA devices")
    if cfg.profiling.enable_memory_snapshot:
        raise ValueError("--profiling.enable_memory_snapshot records the CUDA caching allocator: it needs CUDA devices")


