"""Launches the ranks of a job with torchrun, so that a rank's user error reaches the user as one line.

    python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer options]

The arguments are torchrun's (`torch.distributed.run`), unchanged. Ranks learn from TORCHTITAN_ERROR_DIR where to
write the one line of a user error (bad config value, missing file, diverged loss: torchtitan/errors.py); when
ranks fail, the launcher prints that line once and exits 1, instead of torchrun's ChildFailedError traceback,
which would bury it. A real crash (any other exception, a signal) keeps torchrun's full report.
"""

import logging
import os
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

ERROR_DIR_ENV = "TORCHTITAN_ERROR_DIR"


def write_user_error(message: str) -> bool:
    """Called by a rank that stops on a user error: leaves `message` for the launcher. Returns False when the
    rank was not started by this launcher (then the rank prints the line itself)."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    path = Path(folder) / f"rank{int(os.environ.get('RANK', '0')):05d}.txt"
    path.with_suffix(".tmp").write_text(message)
    path.with_suffix(".tmp").replace(path)  # whole or absent: the launcher may read while ranks are killed
    return True


def _first_user_error(folder: str) -> str | None:
    """The lowest rank's line: ranks that reject the same input all write the same one."""
    files = sorted(Path(folder).glob("rank*.txt"))
    return files[0].read_text().strip() if files else None


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
    with tempfile.TemporaryDirectory(prefix="torchtitan-errors-") as folder:
        os.environ[ERROR_DIR_ENV] = folder  # the ranks inherit the launcher's environment
        with _HeldLogs(logging.getLogger("torch.distributed.elastic")) as held:
            try:
                run(args)
                failure = None
            except ChildFailedError as e:
                failure = e
        message = _first_user_error(folder)
    if failure is not None and message is not None:
        print(f"error: {message}", file=sys.stderr)
        return 1
    held.show()
    if failure is not None:
        raise failure  # a crash: torchrun's report (which rank, exit code or signal, its traceback)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
