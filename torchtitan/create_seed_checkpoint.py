"""Write a seed checkpoint: the full initial weights of a job's model, once, from one process.

    python -m torchtitan.create_seed_checkpoint --job.config_file train_configs/debug_model.toml

writes `{job.dump_folder}/seed_checkpoint` (model only, in training.dtype, with the resolved config and a
manifest), or the folder `--output PATH` names: a local path or an object store URL (`s3://bucket/seed`, written
with the store's commit protocol, docs/object_storage.md). Start every run, whatever its layout, from it with
`--checkpoint.initial_load_path {job.dump_folder}/seed_checkpoint` (or the URL), so all layouts start from
bit-identical weights. On GPUs a sharded run initialises each shard in place with a different random stream
than one process would, so without a seed checkpoint two layouts start from different (equally valid) weights.
"""

import argparse
import os
import sys

from torchtitan.components.checkpoint.manager import CheckpointError, write_model_checkpoint
from torchtitan.components.checkpoint.offline_model import build_cpu_model
from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import config_manager
from torchtitan.tools.precision import DTYPES
from torchtitan.tools.storage import StorageError
from torchtitan.tools.logging import init_logger, logger

FOLDER = "seed_checkpoint"


def main(argv: list[str] | None = None) -> int:
    init_logger()
    try:
        p = argparse.ArgumentParser(add_help=False)  # --help is the job config's
        p.add_argument("--output", default=None)
        args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
        cfg = config_manager().parse_args(rest)
        out = args.output or os.path.join(cfg.job.dump_folder, FOLDER)
        model, _, _, _ = build_cpu_model(cfg)
        model.to(DTYPES[cfg.training.dtype])
        write_model_checkpoint(out, model.state_dict(), cfg, {"step": 0})
    except (ConfigError, ValueError, FileNotFoundError, CheckpointError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    n = sum(t.numel() for t in model.state_dict().values())
    logger.info(
        f"Seed checkpoint of {cfg.model.name} {cfg.model.flavor} ({n:,} values, {cfg.training.dtype}) written to "
        f"{out}; start runs from it with --checkpoint.initial_load_path {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
