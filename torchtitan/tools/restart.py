"""Automatic restart: rerun a failed training command until it finishes, within a restart budget.

    python -m torchtitan.tools.restart --max-restarts 3 [--same-failure-limit 3] -- \
        python -m torchtitan.launch --max-restarts 0 ... -m torchtitan.train ...

Each attempt is one run of the command (the launcher, i.e. torchrun, with its own --max-restarts 0). A restarted run resumes from
the last complete checkpoint by itself (the trainer loads the newest complete `step-N` of its run folder), so
no user action is needed. Between attempts the ranks' failures are compared: a job that fails the same way
`same_failure_limit` times in a row without progress stops with one line, since restarting cannot help it (a
full disk, a deterministic crash); a job that fails differently (a killed rank, a lost node) is restarted until
the budget is spent. Only attempts that made no progress count towards the streak: an attempt that completed a
checkpoint newer than the one it resumed from (rank 0 says so through `record_progress`) ends any streak, so
independent failures of a long run at different steps, the same signature every time (a SIGKILLed rank), are
restarted as long as the budget lasts. A configuration error is never restarted.

How a rank reports its failure: the supervisor sets TORCHTITAN_FAILURE_DIR per attempt and TORCHTITAN_ATTEMPT
(the launcher sets its own folder when it runs alone); `record_failure` (called by the entry point) writes one
line per failing rank there. A rank that dies without
a word (SIGKILL, a crash in C++) writes nothing, and its peers report the broken connection.

SIGTERM or SIGINT to the supervisor (the scheduler stopping the job) is passed to the command and ends the
loop: a preempted job is resubmitted by the scheduler, not restarted here.

This module does not import torch: it starts in milliseconds and a launcher can call `run_with_restarts`.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

FAILURE_DIR_ENV = "TORCHTITAN_FAILURE_DIR"
ATTEMPT_ENV = "TORCHTITAN_ATTEMPT"
LAUNCHED_ENV = "TORCHTITAN_LAUNCHED"  # set by torchtitan/launch.py: it prints a rank's user error, the rank does not
PROGRESS_FILE = "checkpoints.progress"  # not *.json: read_failure reads those as the ranks' reports
SILENT_DEATH = "a rank died without reporting an error (killed by a signal or crashed) and none of its peers reported one"


def record_failure(message: str, *, restartable: bool = True, user_error: bool = False) -> None:
    """Called by a failing rank: its one-line reason, for the launcher (which prints a user error's line once,
    torchtitan/launch.py) and the supervisor (which compares failures between attempts)."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    rank = os.environ.get("RANK", "0")
    record = {"rank": int(rank), "error": message, "restartable": restartable, "user_error": user_error,
              "time": time.time(), "pid": os.getpid()}
    path = os.path.join(folder, f"rank-{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)  # whole or absent: the readers may look while ranks are being killed
    except OSError:
        pass  # reporting must never hide the failure itself


def record_progress(*, resumed_from: int | None = None, saved: int | None = None) -> None:
    """Called by rank 0: the step this attempt resumed from (when it loaded a checkpoint) and the newest
    complete checkpoint it wrote, for the supervisor's "made progress" judgement."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not folder:
        return
    path = os.path.join(folder, PROGRESS_FILE)
    state = _read_progress(folder)
    if resumed_from is not None:
        state.setdefault("resumed_from", resumed_from)  # the attempt's start; a later reload (rollback) is not
    if saved is not None:
        state["saved"] = max(saved, state.get("saved", saved))
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(state, f)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # without it the attempt only counts as "no progress": the streak rule stays safe


def _read_progress(folder: str) -> dict:
    try:
        with open(os.path.join(folder, PROGRESS_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def made_progress(folder: str) -> bool:
    """Whether the attempt whose report folder this is completed a checkpoint newer than its starting point."""
    state = _read_progress(folder)
    saved = state.get("saved")
    return saved is not None and saved > state.get("resumed_from", 0)


@dataclass
class Failure:
    signature: str  # what the attempt died of: equal signatures mean "the same failure"
    restartable: bool
    user_error: bool = False  # a bad input or a stop the user can fix (torchtitan/errors.py), said in one line


def read_failure(folder: str) -> Failure:
    """The failure of one attempt: the earliest report (the first rank to fail is the cause; its peers then
    report broken connections), or a silent death."""
    reports = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                reports.append(json.load(f))
        except (OSError, ValueError):
            continue
    if not reports:
        return Failure(SILENT_DEATH, True)
    first = min(reports, key=lambda r: (r["time"], r["rank"]))
    return Failure(first["error"], all(r["restartable"] for r in reports), bool(first.get("user_error")))



def peer_reported_user_error() -> bool:
    """Called by a rank that failed otherwise (e.g. a collective's broken connection): whether, under this
    launcher, the job's first failure is another rank's user error. The launcher prints that line; this rank's
    traceback would only bury it."""
    folder = os.environ.get(FAILURE_DIR_ENV)
    if not os.environ.get(LAUNCHED_ENV) or not folder or not os.path.isdir(folder):
        return False
    return read_failure(folder).user_error

def run_with_restarts(cmd: list[str], max_restarts: int, same_failure_limit: int = 3, log=None) -> int:
    """Runs `cmd` until it exits 0, restarting it at most `max_restarts` times; returns the exit code."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    stop = {"signal": None}
    child: dict[str, subprocess.Popen | None] = {"proc": None}

    def forward(signum, frame):
        stop["signal"] = signum
        if child["proc"] is not None and child["proc"].poll() is None:
            child["proc"].send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    streak: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="torchtitan-failures-") as reports:
            for attempt in range(max_restarts + 1):
                folder = os.path.join(reports, f"attempt-{attempt}")
                os.makedirs(folder)
                env = {**os.environ, FAILURE_DIR_ENV: folder, ATTEMPT_ENV: str(attempt)}
                child["proc"] = subprocess.Popen(cmd, env=env)
                code = child["proc"].wait()
                if code == 0 or stop["signal"] is not None:
                    return code
                failure = read_failure(folder)
                if not failure.restartable:
                    return code  # the rank said why on its own; a restart would say it again
                if made_progress(folder):
                    streak = []  # it got further than the attempt before: not the same failure again
                elif streak[-1:] == [failure.signature]:
                    streak.append(failure.signature)
                else:
                    streak = [failure.signature]
                if len(streak) >= same_failure_limit:
                    log(f"error: the run failed the same way {len(streak)} times in a row without progress (no "
                        f"newer complete checkpoint), so it is not restarted "
                        f"again: {failure.signature}; fix the cause, then rerun the same command to resume")
                    return code
                if attempt == max_restarts:
                    if attempt > 0:  # with no restart allowed the attempt's own report is the whole story
                        log(f"error: the run failed {attempt + 1} times and its restart budget (--max-restarts "
                            f"{max_restarts}) is spent; last failure: {failure.signature}")
                    return code
                log(f"restart: attempt {attempt} failed ({failure.signature}); restarting from the last complete "
                    f"checkpoint ({max_restarts - attempt} restart(s) left)")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchtitan.tools.restart",
        description="Rerun a training command after a failure; the rerun resumes from the last complete checkpoint.",
    )
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts allowed after the first attempt")
    parser.add_argument("--same-failure-limit", type=int, default=3,
                        help="stop when this many attempts in a row failed the same way without completing a newer "
                             "checkpoint")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command (e.g. torchrun ...)")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("no command given; put it after --")
    if args.max_restarts < 0 or args.same_failure_limit < 1:
        parser.error("--max-restarts must be >= 0 and --same-failure-limit >= 1")
    return run_with_restarts(cmd, args.max_restarts, args.same_failure_limit)


if __name__ == "__main__":
    sys.exit(main())
