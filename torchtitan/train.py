"""Entry point: `python -m torchtitan.train [--job.config_file recipe.toml] [--section.key value ...]`.

Launch with `./run_train.sh` (torchrun). The trainer itself lives in `torchtitan/trainer.py`.
"""

import gc
import os
import sys

if __name__ == "__main__":  # before torch's first CPU tensor (importing torch.distributed makes one)
    from torchtitan.tools import cpu_malloc, cuda_alloc, rank_stderr

    rank_stderr.enable_early()  # a fatal signal prints every thread's stack from here on
    cpu_malloc.choose_at_start()
    cuda_alloc.choose_at_start()  # before the first CUDA allocation, when the allocator reads its settings

from torchtitan.config import ConfigError  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.protocols.train_spec import config_manager  # noqa: E402
from torchtitan.errors import USER_ERRORS  # noqa: E402
from torchtitan.planning.memory_budget import resolve_budget  # noqa: E402
from torchtitan.tools import cpu_malloc, rank_stderr  # noqa: E402
from torchtitan.tools.restart import LAUNCHED_ENV, peer_reported_user_error, record_failure  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

PREEMPTED_EXIT = 143  # 128 + SIGTERM: the run stopped early (checkpoint saved); rerunning it resumes


def _say(error: Exception) -> None:
    # Under ./run_train.sh the launcher (torchtitan/launch.py) prints the line once, after torchrun stopped
    # every rank; a rank started otherwise says it itself.
    if not os.environ.get(LAUNCHED_ENV):
        print(f"error: {error}", file=sys.stderr)


def main(argv: list[str] | None = None, *, own_process: bool = False) -> int:
    """Trains; returns the exit code. `own_process`: this process is the rank (python -m torchtitan.train),
    so its stderr may be taken over (tools/rank_stderr.py), which an in-process caller's must not be."""
    try:
        cfg = config_manager().parse_args(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        record_failure(str(e), restartable=False, user_error=True)
        _say(e)
        return 2
    if own_process:  # an in-process caller (tests) keeps its own process as it is
        # Options that need another process image (huge pages off, a preloaded allocator): restarts once, the
        # same pid. Before the tee below, which a restart would start twice.
        cpu_malloc.respect_options(cfg.training.cpu_huge_pages, cfg.training.cpu_allocator)
        rank_stderr.capture(cfg.job.dump_folder, int(os.environ.get("RANK", "0")))
    trainer, preempted_at = None, None
    try:
        # A memory budget becomes per-block choices here, before the trainer builds anything.
        cfg, budget = resolve_budget(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if budget is not None and int(os.environ.get("RANK", "0")) == 0:
            print(budget.summary(), flush=True)
        trainer = Trainer(cfg)
        trainer.train()
    except USER_ERRORS as e:
        record_failure(str(e), restartable=getattr(e, "restartable", True), user_error=True)
        if os.environ.get("TORCHTITAN_TRACEBACK"):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            _say(e)
        return 1
    except BaseException as e:  # a bug or a broken peer: the traceback follows; the supervisor gets the gist
        record_failure(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        if peer_reported_user_error():  # a peer stopped on a user error first (its line is printed) and broke
            return 1  # this rank's collective: a traceback would bury that line
        raise
    finally:
        if trainer is not None:
            trainer.close()
            preempted_at = trainer.train_state.step if trainer.preempted else None
        else:
            dist_utils.end_distributed()
        # The trainer's meshes hold the process groups: dropped here, their threads (gloo's) end before this
        # function returns instead of running through the interpreter's exit (distributed/utils.end_distributed).
        trainer = None
        gc.collect()
    if preempted_at is not None:
        record_failure(f"preempted (SIGTERM) after step {preempted_at}, its checkpoint saved")
        return PREEMPTED_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(own_process=True))
