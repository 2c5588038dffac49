"""Checks a job before the launcher starts any rank: the recipe, the model, the tokenizer, the layout.

    python -m torchtitan.preflight --world-size 8 --job.config_file recipe.toml [--section.key value ...]

Prints one line naming the problem and exits non-zero on bad input; otherwise exits 0, printing only the memory
plan when the job has a --memory.budget_gib.
"""

import os
import sys

from torchtitan.config import ConfigError
from torchtitan.protocols.train_spec import config_manager


def main(argv: list[str]) -> int:
    world_size = 1
    if argv[:1] == ["--world-size"]:
        world_size, argv = int(argv[1]), argv[2:]
    nnodes = int(os.environ.get("NNODES", "1"))
    try:
        cfg = config_manager().parse_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from torchtitan.errors import USER_ERRORS
    from torchtitan.job_plan import plan_job
    from torchtitan.planning.memory_budget import plan_budget

    try:
        budget = plan_budget(cfg, plan_job(cfg, world_size * nnodes))
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if budget is not None:
        print(budget.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
