"""Launches the ranks of a job with torchrun, so that a rank's user error reaches the user as one line.

    python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer options]

The arguments are torchrun's (`torch.distributed.run`), unchanged. Failing ranks write their one-line reason to
the folder in TORCHTITAN_FAILURE_DIR (torchtitan.tools.restart.record_failure; the restart supervisor sets it
per attempt, else the launcher makes one). When the first failure is a user error (bad config value, missing
file, diverged loss: torchtitan/errors.py), the launcher prints that line once and exits 1, instead of torchrun's
ChildFailedError traceback, which would bury it. A real crash (any other exception, a signal) keeps torchrun's
full report.
"""

import logging
import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from torchtitan.tools.restart import FAILURE_DIR_ENV, LAUNCHED_ENV, read_failure

class _HeldLogs(logging.Handler):
    """Holds torchrun's own log lines (a worker failed, stopping the others, ...) while the ranks run: after a
    user error they are noise, otherwise they are shown once the outcome is known."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger, self.records = logger, []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "_HeldLogs":
        self.logger.addHandler(self)
        self.logger.propagate = False
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.propagate = True

    def show(self) -> None:
        for record in self.records:
            logging.getLogger(record.name).handle(record)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchtitan-failures-") as own:
        folder = os.environ.setdefault(FAILURE_DIR_ENV, own)  # the ranks inherit the launcher's environment
        os.environ[LAUNCHED_ENV] = "1"
        with _HeldLogs(logging.getLogger("torch.distributed.elastic")) as held:
            try:
                run(args)
                failure = None
            except ChildFailedError as e:
                failure = e
        reported = read_failure(folder) if failure is not None else None
    if reported is not None and reported.user_error:
        print(f"error: {reported.signature}", file=sys.stderr)
        return 1
    held.show()
    if failure is not None:
        raise failure  # a crash: torchrun's report (which rank, exit code or signal, its traceback)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
