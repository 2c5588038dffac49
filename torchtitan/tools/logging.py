"""The project-wide logger.

Every module logs through `logger` so one call to `init_logger` at start-up decides the format and level for
the whole run.
"""

import logging
import os
import sys

logger = logging.getLogger("torchtitan")


def init_logger(rank: int = 0) -> None:
    """Send INFO and above to stdout as `[titan] 2026-11-30 10:00:00,123 - INFO - msg`.

    With several processes (WORLD_SIZE > 1) lines get a `[rank N]` prefix so interleaved output stays readable.
    Calling it again replaces the handler instead of stacking a second one (which would print every line twice).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank_prefix = f"[rank {rank}] " if world_size > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"{rank_prefix}[titan] %(asctime)s - %(levelname)s - %(message)s"))
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
