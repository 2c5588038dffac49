"""Score evaluation tasks on a checkpoint: `python -m torchtitan.eval CHECKPOINT [options] [--section.key V ...]`.

CHECKPOINT is any checkpoint the project writes: a DCP step checkpoint (full), an export, a seed checkpoint, or a
Hugging Face folder (config.json; its tokenizer.json is used unless --model.tokenizer_path says otherwise).
The model's shape and tokenizer come from the checkpoint's config.toml; trailing --section.key options override
it (--eval.tasks, --eval.limit, --eval.num_fewshot, --eval.local_batch_size, --training.seq_len = the window).

One process, or many under torchrun (`torchrun --nproc_per_node 4 -m torchtitan.eval CKPT`): every process
holds the whole model and scores its share of the batches; the results are summed over the processes.
Prints one line per task and metric; --output FILE writes the metrics and every request's log-likelihood as
JSON.
"""

import argparse
import json
import os
import sys



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--output", help="JSON file for the metrics and each request's log-likelihood")
    args, overrides = p.parse_known_args(argv)

    from torchtitan.components.checkpoint.manager import CheckpointError
    from torchtitan.components.checkpoint.offline_model import (
        build_cpu_model,
        is_hf_folder,
        job_config_of,
        load_model_weights,
    )
    from torchtitan.config import ConfigError
    from torchtitan.eval.runner import Evaluator, plain_forward_sums
    from torchtitan.eval.tasks import TaskError

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = job_config_of(args.checkpoint, overrides)
        if is_hf_folder(args.checkpoint) and cfg.model.tokenizer_path is None \
                and os.path.isfile(os.path.join(args.checkpoint, "tokenizer.json")):
            cfg.model.tokenizer_path = args.checkpoint
        model, spec, tokenizer, model_args = build_cpu_model(cfg)
        load_model_weights(model, args.checkpoint, spec.state_dict_adapter, model_args)
        model.eval()
        evaluator = Evaluator(cfg.eval, tokenizer, cfg.training.seq_len)
    except (ConfigError, CheckpointError, TaskError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reduce_sum = lambda x: x  # noqa: E731
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")

        def reduce_sum(x):
            dist.all_reduce(x)
            return x

    try:
        metrics = evaluator.run(plain_forward_sums(model), rank, world, reduce_sum)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    if rank == 0:
        for key, value in metrics.items():
            print(f"{key} {value:.6g}")
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"metrics": metrics, "loglikelihoods": evaluator.last_loglikelihoods}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
