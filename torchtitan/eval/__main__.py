"""Score evaluation tasks on a checkpoint: `python -m torchtitan.eval CHECKPOINT [options] [--section.key V ...]`.

CHECKPOINT is any checkpoint the project writes: a DCP step checkpoint (full), an export, a seed checkpoint, or a
Hugging Face folder (config.json; its tokenizer.json is used unless --model.tokenizer_path says otherwise).
The model's shape and tokenizer come from the checkpoint's config.toml; trailing --section.key options override
it (--eval.tasks, --eval.limit, --eval.num_fewshot, --eval.local_batch_size, --training.seq_len = the window).

The model is built, laid out and loaded as the trainer does (torchtitan/model_runtime.py): one process, or
under torchrun in any layout the trainer supports, read from --parallelism.* as the trainer reads them
(FSDP, TP, PP, CP, EP and their compositions); cuda+nccl when GPUs are visible, cpu+gloo otherwise. With no
--parallelism options the layout is the trainer's default, FSDP over all ranks: every rank holds 1/N of the
weights and scores 1/N of the batches (`--parallelism.data_parallel_shard_degree 1
--parallelism.data_parallel_replicate_degree N` keeps a whole copy per rank instead). Only the weights are
loaded (DCP reshards a checkpoint into the layout; a Hugging Face folder is read by each rank for its own
slices); no optimizer state is read or allocated. The layout of the run that wrote the checkpoint (its
[parallelism], [checkpoint], [memory], [fault_tolerance], [guard] and [comm] sections, and its
training.global_batch_size) is not reused: those come from the defaults and the command line. A layout that
does not fit the world or the model is refused in one line before any process group starts.

Prints one line per task and metric; --output FILE writes the metrics and every request's log-likelihood as
JSON.
"""

import argparse
import gc
import json
import os
import sys

# What a checkpoint's config.toml says about the run that wrote it rather than about its model: scoring takes
# these sections from the defaults and the command line.
RUN_SECTIONS = ("parallelism", "checkpoint", "memory", "fault_tolerance", "guard", "comm")


def scoring_config(checkpoint: str, overrides: list[str]):
    """The job config that scores `checkpoint`: its saved config (a Hugging Face folder: its config.json and
    tokenizer.json), the run's own layout sections reset, `overrides` on top, its weights as the initial load."""
    from torchtitan.components.checkpoint.offline_model import is_hf_folder, job_config_of
    from torchtitan.protocols.train_spec import config_manager

    cfg = job_config_of(checkpoint, overrides)
    named = any(o == "--model.name" or o.startswith("--model.name=") for o in overrides)
    fresh = config_manager(skip_retired=True).parse_args(([] if named else ["--model.name", cfg.model.name])
                                                         + list(overrides))
    for section in RUN_SECTIONS:
        setattr(cfg, section, getattr(fresh, section))
    cfg.training.global_batch_size = fresh.training.global_batch_size  # derived from the scoring layout
    hf = is_hf_folder(checkpoint)
    if hf and cfg.model.tokenizer_path is None and os.path.isfile(os.path.join(checkpoint, "tokenizer.json")):
        cfg.model.tokenizer_path = checkpoint
    cfg.eval.enable = True  # pre-flight reads every task and builds every request
    c = cfg.checkpoint
    c.enable, c.initial_load_path, c.initial_load_model_only, c.initial_load_in_hf = False, checkpoint, True, hf
    return cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--output", help="JSON file for the metrics and each request's log-likelihood")
    args, overrides = p.parse_known_args(argv)

    from torchtitan.components.checkpoint.manager import CheckpointError
    from torchtitan.config import ConfigError
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.errors import USER_ERRORS
    from torchtitan.eval.runner import Evaluator
    from torchtitan.job_plan import plan_job
    from torchtitan.model_runtime import ModelRuntime
    from torchtitan.tools import storage

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:  # pre-flight: the same judge as the trainer's, before any process group exists
        if not storage.isdir(args.checkpoint):
            raise CheckpointError(f"checkpoint {args.checkpoint}: no such folder")
        cfg = scoring_config(args.checkpoint, overrides)
        plan = plan_job(cfg, world)
    except USER_ERRORS as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    runtime = None
    try:
        runtime = ModelRuntime.for_checkpoint(cfg, plan, quiet=True)
        evaluator = Evaluator(cfg.eval, plan.tokenizer, cfg.training.seq_len)
        metrics = runtime.score_tasks(evaluator)
    except USER_ERRORS as e:  # a checkpoint that does not fit: every rank finds it while loading
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:  # the mesh holds the process groups: dropped and collected, their threads end here (train.py)
        dist_utils.end_distributed()
        runtime = None
        gc.collect()
    if rank == 0:
        for key, value in metrics.items():
            print(f"{key} {value:.6g}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"metrics": metrics, "loglikelihoods": evaluator.last_loglikelihoods}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
