"""Entry point: `python -m torchtitan.train [--job.config_file recipe.toml] [--section.key value ...]`.

Launch with `./run_train.sh` (torchrun). The trainer itself lives in `torchtitan/trainer.py`.
"""

import os
import sys

import torch.distributed as dist

from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import config_manager
from torchtitan.errors import USER_ERRORS
from torchtitan.launch import write_user_error
from torchtitan.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = config_manager().parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        if not write_user_error(str(e)):
            print(f"error: {e}", file=sys.stderr)
        return 2
    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.train()
    except USER_ERRORS as e:
        if os.environ.get("TORCHTITAN_TRACEBACK"):
            raise
        # Under ./run_train.sh the launcher prints the line once, after torchrun stopped every rank.
        if not write_user_error(str(e)) and int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
