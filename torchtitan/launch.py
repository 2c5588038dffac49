"""Launches the ranks of a job with torchrun, so that a rank's user error reaches the user as one line.

    python -m torchtitan.launch [torchrun options] -m torchtitan.train [trainer options]

The arguments are torchrun's (`torch.distributed.run`), unchanged. Failing ranks write their one-line reason to
the folder in TORCHTITAN_FAILURE_DIR (torchtitan.tools.restart.record_failure; the restart supervisor sets it
per attempt, else the launcher makes one). When the first failure is a user error (bad config value, missing
file, diverged loss: torchtitan/errors.py), the launcher prints that line once and exits 1, instead of torchrun's
ChildFailedError traceback, which would bury it (and a peer whose collective broke because of it exits without
its traceback: `tools.restart.peer_reported_user_error`). A real crash (any other exception, a signal) keeps torchrun's full
report.

After a user error the other ranks are collateral. torchrun stops them with SIGTERM, but a rank blocked in a NCCL
collective (waiting for the rank that failed) runs no Python signal handler, and torchrun waits 30 s before it
kills it; so once a rank has reported a user error and a rank has exited, the ranks still running PEER_GRACE_S
later are killed by the launcher (ranks of this node: another node's launcher sees only its own ranks).
"""

import glob
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time

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


PEER_GRACE_S = 5.0  # seconds the other ranks get to end by themselves after a rank reported a user error


class _PeerStopper(threading.Thread):
    """Kills this launcher's child processes (the ranks) PEER_GRACE_S after a rank that reported a user error
    has exited."""

    def __init__(self, folder: str) -> None:
        super().__init__(daemon=True)
        self.folder, self.done, self.started = folder, threading.Event(), time.time()

    def _reporters(self) -> list[int]:
        """The pids of the ranks of this launch (not stale files in a reused folder) that wrote a failure."""
        pids = []
        for path in glob.glob(os.path.join(glob.escape(self.folder), "*.json")):
            try:
                if os.path.getmtime(path) >= self.started - 1:
                    with open(path) as f:
                        pids.append(int(json.load(f).get("pid", -1)))
            except (OSError, ValueError):  # replaced or removed meanwhile, or half written
                continue
        return pids

    def run(self) -> None:
        while not self.done.wait(0.2):
            reporters = self._reporters()
            # The grace starts once a reporting rank has exited (it may still be finishing a checkpoint): its pid
            # is watched, not the count of running ranks, since under load a rank can fail and exit before this
            # thread ever saw every rank running.
            if reporters and not all(_running(pid) for pid in reporters) and read_failure(self.folder).user_error:
                if not self.done.wait(PEER_GRACE_S):
                    for pid in _children():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                return

    def __enter__(self) -> "_PeerStopper":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()


def _children() -> list[int]:
    """This process's running child processes (Linux /proc; none found elsewhere, leaving the stop to torchrun)."""
    pids = []
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return [pid for pid in pids if _running(pid)]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the (command name)
    except (OSError, IndexError):
        return False


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torchtitan-failures-") as own:
        folder = os.environ.setdefault(FAILURE_DIR_ENV, own)  # the ranks inherit the launcher's environment
        os.environ[LAUNCHED_ENV] = "1"
        with _HeldLogs(logging.getLogger("torch.distributed.elastic")) as held, _PeerStopper(folder):
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
        for rank, f in sorted(failure.failures.items()):
            if f.exitcode < 0 and f.signal_name() not in ("SIGTERM", "SIGKILL"):  # SIGKILL leaves nothing to read
                print(f"rank {rank} died of {f.signal_name()}: its stderr, with every thread's stack and any C/C++ "
                      f"message, is in ranks/rank-{rank}.stderr under the run's --job.dump_folder "
                      f"(tools/rank_stderr.py)", file=sys.stderr)
        raise failure  # a crash: torchrun's report (which rank, exit code or signal, its traceback)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
