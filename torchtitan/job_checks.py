"""Values of a job that can be judged before any rank starts: number ranges, the run folder, local data files.

Called by `plan_job`, so the launcher's pre-flight check rejects them with one line (naming the option, its
value and what it must be) before torchrun starts anything; the ranks would otherwise fail later, one by one,
often with a raw exception (`--training.local_batch_size 0` was a ZeroDivisionError).
"""

import math
import os
from collections.abc import Callable
from pathlib import Path

from torchtitan.tools import storage
from torchtitan.components.optim.lr_scheduler import check_schedule
from torchtitan.components.faults.step_guard import check_guard_config
from torchtitan.config import JobConfig
from torchtitan.datasets.dataloader import check_shard_folder, is_dataset_name, parse_mixture
from torchtitan.datasets.schedule import mixture_schedule
from torchtitan.datasets.sources import DATASETS, local_data_files, open_documents
from torchtitan.tools import cpu_malloc


def _at_least(n: int) -> tuple[Callable[[object], bool], str]:
    return (lambda v: v >= n), f"at least {n}"


def _positive_number() -> tuple[Callable[[object], bool], str]:
    return (lambda v: math.isfinite(v) and v > 0), "a positive number"


def _non_negative_number() -> tuple[Callable[[object], bool], str]:
    return (lambda v: math.isfinite(v) and v >= 0), "a number >= 0"


def _fraction(upper_open: bool = False) -> tuple[Callable[[object], bool], str]:
    if upper_open:
        return (lambda v: 0.0 <= v < 1.0), "in [0, 1)"
    return (lambda v: 0.0 <= v <= 1.0), "in [0, 1]"


def _minus_one_or_at_least(n: int, meaning: str) -> tuple[Callable[[object], bool], str]:
    return (lambda v: v == -1 or v >= n), f"-1 ({meaning}) or at least {n}"


# option -> (rule, what the rule says). Options whose range depends on the world size (parallel degrees, batch
# divisibility) are judged by ParallelDims in plan_job.
_RULES = {
    "training.local_batch_size": _at_least(1),
    "training.global_batch_size": _minus_one_or_at_least(1, "local_batch_size x data-parallel degree"),
    "training.seq_len": _at_least(1),
    "training.steps": _at_least(1),
    "training.gc_freq": _at_least(1),
    "training.source_retries": ((lambda v: v >= 0), "0 (fail at the first error) or more"),
    "training.source_retry_backoff_s": _non_negative_number(),
    "training.loss_chunk_size": _minus_one_or_at_least(1, "auto"),
    "memory.budget_gib": ((lambda v: math.isfinite(v) and v >= 0), "0 (no budget) or a positive number of GiB"),
    "memory.host_gib": ((lambda v: math.isfinite(v) and v >= 0), "0 (this machine's RAM) or a positive number of GiB"),
    "memory.offload_bandwidth_gbps": ((lambda v: math.isfinite(v) and v >= 0),
                                      "0 (the stated default) or a positive number"),
    "validation.freq": _at_least(1),
    "validation.steps": _minus_one_or_at_least(1, "the whole validation split"),
    "validation.local_batch_size": _at_least(1),
    "eval.freq": _at_least(1),
    "eval.local_batch_size": _at_least(1),
    "eval.limit": _minus_one_or_at_least(1, "every document"),
    "eval.num_fewshot": _minus_one_or_at_least(0, "each task's own"),
    "eval.bootstrap_iters": ((lambda v: v >= 0), "0 (no bootstrapped stderr) or more"),
    "optimizer.lr": _non_negative_number(),  # 0 is legitimate: weights stay put (probes, evaluation runs)
    "optimizer.beta1": _fraction(upper_open=True),
    "optimizer.beta2": _fraction(upper_open=True),
    "optimizer.eps": _positive_number(),
    "optimizer.weight_decay": _non_negative_number(),
    "parallelism.pipeline_parallel_microbatch_size": _at_least(1),
    "checkpoint.interval": _at_least(1),
    "checkpoint.keep_latest_k": ((lambda v: v >= 0), "0 (keep all) or more"),
    "checkpoint.load_step": _minus_one_or_at_least(0, "the latest checkpoint"),
    "checkpoint.hf_interval": ((lambda v: v >= 0), "0 (only as last_save says) or more"),  # < 0 was taken as 0
    "checkpoint.hf_max_shard_mb": _at_least(1),
    "metrics.log_freq": _at_least(1),
    "training.cpu_kept_heap_growth": _positive_number(),
    "profiling.profile_freq": _at_least(1),
    "activation_checkpoint.memory_budget": _fraction(),
    "comm.init_timeout_seconds": _at_least(1),
    "comm.train_timeout_seconds": _at_least(1),
    "comm.hang_timeout_seconds": _non_negative_number(),
    "job.storage_retry_seconds": _non_negative_number(),  # 0 turns the hang watch off; -1 was taken silently
}


def check_job_values(cfg: JobConfig) -> None:
    """Raises ValueError / FileNotFoundError with one line for the first value of `cfg` that cannot work."""
    for option, (ok, rule) in _RULES.items():
        section, key = option.split(".")
        value = getattr(getattr(cfg, section), key)
        if not ok(value):
            raise ValueError(f"--{option} must be {rule}, got {value}")
    check_schedule(cfg.lr_scheduler, cfg.training.steps)
    check_guard_config(cfg.guard, cfg.checkpoint.enable)
    _check_retention(cfg)
    if cfg.checkpoint.hf_interval and not cfg.checkpoint.enable:  # the checkpointer writes hf-step-N; off, nothing was
        raise ValueError(f"--checkpoint.hf_interval {cfg.checkpoint.hf_interval} writes hf-step-N folders from the "
                         f"checkpointer: add --checkpoint.enable (or drop hf_interval)")
    _check_hf_saves_of_adapters(cfg)
    if cfg.training.loss_chunk_size > cfg.training.seq_len:
        raise ValueError(f"--training.loss_chunk_size {cfg.training.loss_chunk_size} is longer than the sequence "
                         f"(--training.seq_len {cfg.training.seq_len}); use at most {cfg.training.seq_len} ({cfg.training.seq_len} = the plain loss), or -1 (auto)")
    if cfg.training.cpu_allocator in cpu_malloc.ALLOCATORS:  # a named allocator must be there to preload
        cpu_malloc.wanted_allocator(cfg.training.cpu_allocator, accelerator=False)
    _check_creatable_folder(cfg.job.dump_folder)
    _check_store(cfg)
    t = cfg.training
    mixture = parse_mixture(t.datasets) if t.datasets else [(t.dataset, 1.0)]
    mixture_schedule(cfg, mixture)  # phases: weights that parse, known sources, increasing steps
    sources = [s for s, _ in mixture]
    for source in sources:
        if not is_dataset_name(source):
            check_shard_folder(source, "train")  # reading the shards (tokenizer hash) is the ranks' job
            if cfg.validation.enable:  # else found only at the first validation, after the steps before it
                check_shard_folder(source, "validation")
            continue
        if source not in DATASETS or (source == "local" and not t.dataset_path):
            open_documents(source, t.dataset_path, "train")  # raises its line: unknown name, no dataset_path
        if source == "local":
            local_data_files(t.dataset_path)  # exists, one format, no empty file; parsing them is the ranks' job


def _check_retention(cfg: JobConfig) -> None:
    """Milestone options that could keep nothing, or that say two things at once."""
    c = cfg.checkpoint
    if c.keep_every_n_steps < 0:
        raise ValueError(f"--checkpoint.keep_every_n_steps must be 0 (no milestones) or more, got {c.keep_every_n_steps}")
    if (c.keep_every_n_steps or c.keep_steps) and c.keep_latest_k == 0:
        raise ValueError("--checkpoint.keep_latest_k 0 keeps every checkpoint already; milestones "
                         "(--checkpoint.keep_every_n_steps / keep_steps) need keep_latest_k > 0")
    if c.keep_every_n_steps % c.interval:
        raise ValueError(f"--checkpoint.keep_every_n_steps {c.keep_every_n_steps} would keep no checkpoint: saves "
                         f"happen every --checkpoint.interval {c.interval} steps; choose a multiple of it")
    unsaved = [s for s in c.keep_steps if s < 1 or (s % c.interval and s != cfg.training.steps)]
    if unsaved:
        raise ValueError(f"--checkpoint.keep_steps {unsaved[0]} is not a saved step (a multiple of "
                         f"--checkpoint.interval {c.interval}, or --training.steps)")


def _check_hf_saves_of_adapters(cfg: JobConfig) -> None:
    """A LoRA run's model is a frozen base plus adapters that no Hugging Face architecture holds; the run's
    own HF saves (which write the sharded model as it is) failed at their first step, after the training."""
    c = cfg.checkpoint
    hf = [f"--checkpoint.hf_interval {c.hf_interval}"] if c.hf_interval else []
    hf += [f"--checkpoint.last_save {c.last_save}"] if c.last_save in ("full_and_hf", "hf_only") else []
    if hf and "lora" in cfg.model.converters:
        raise ValueError(f"{hf[0]} writes the model as trained, and --model.converters lora trains adapters that "
                         f"no Hugging Face model holds: keep --checkpoint.last_save full and write the folder from "
                         f"a step checkpoint with scripts/checkpoints/convert_to_hf.py (adapters merged, or --peft BASE)")


def _check_store(cfg: JobConfig) -> None:
    """A checkpoint folder on an object store: a small test object is written, read back and removed, so an
    unreachable store, a missing bucket or denied writes are one line before any rank starts."""
    folder = cfg.checkpoint.folder
    if cfg.checkpoint.enable and storage.is_url(folder):
        why = storage.probe(folder)
        if why is not None:
            raise ValueError(f"--checkpoint.folder {why}")


def _check_creatable_folder(folder: str) -> None:
    """The run folder exists as a folder, or can be created: its nearest existing ancestor is a writable folder."""
    path = Path(folder).expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--job.dump_folder {folder} cannot be created: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--job.dump_folder {folder} cannot be written: no write permission on {existing}")
