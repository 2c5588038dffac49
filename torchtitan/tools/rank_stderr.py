"""Each rank's stderr also in a file of its own, and a fatal signal's stacks in it (issue 31: a rank died of
SIGABRT once in eight runs and left only torchrun's "Signal 6 received by PID ...").

What a dying rank writes goes to its stderr: Python's faulthandler (every thread's Python stack on SIGABRT,
SIGSEGV, SIGBUS, SIGFPE, SIGILL), libstdc++'s "terminate called after throwing an instance of 'c10::Error'
what(): ..." (a C++ exception on a thread of gloo or c10), glibc's "free(): invalid pointer" (heap corruption).
But under ./run_train.sh only the ranks in LOG_RANK (rank 0 by default) reach the console, and torchrun keeps
the others' output in a temporary folder. So the entry point (torchtitan/train.py, a process of its own) calls
`capture`, which:

- routes file descriptor 2 through `tee` (a process in its own session, so Ctrl-C or a kill of the rank's group
  leaves it to write the last lines) into `{dump_folder}/ranks/rank-N.stderr` and the original stderr: every
  native write, Python's or C++'s or glibc's, lands in both, and tee outlives the rank that aborts;
- turns faulthandler on over that stream, all threads;
- at a normal exit, after Python printed any uncaught traceback, hands fd 2 back and waits (5 s at most) for
  tee to write everything: torchrun stops reading a rank's output once the rank has exited;
- sets LIBC_FATAL_STDERR_=1 (glibc writes its fatal messages to /dev/tty, not stderr, unless told), unless
  the environment says otherwise. (TORCH_SHOW_CPP_STACKTRACES=1, C++ frames in c10's errors, stays the user's
  choice, as in scripts/diagnostics/cp_abort_loop.py: on by default it would print a warning for every c10
  error Python catches.)

The training log itself goes to stdout (tools/logging.py), so the file holds warnings, tracebacks and what a
dying process says. Before `capture` (argument parsing) faulthandler writes to stderr only. Where `tee` is
missing the file gets faulthandler's output alone.
"""

import atexit
import faulthandler
import os
import shutil
import subprocess
import sys

_tee: subprocess.Popen | None = None  # kept: its stdin is this process's stderr


def path_for(dump_folder: str, rank: int) -> str:
    return os.path.join(dump_folder, "ranks", f"rank-{rank}.stderr")


def _native_messages_on() -> None:
    # glibc reads it when it writes a fatal message. TORCH_SHOW_CPP_STACKTRACES=1 is not set: it makes every
    # c10::Error symbolize its C++ stack, caught ones too (3x the cost of one, measured) with a warning line
    # each, and an abort's own message (libstdc++'s terminate line, with what()) reaches stderr without it.
    os.environ.setdefault("LIBC_FATAL_STDERR_", "1")


def enable_early() -> None:
    """faulthandler on stderr, all threads, and glibc's fatal messages to stderr: covers the time before the dump
    folder is known."""
    _native_messages_on()
    faulthandler.enable(file=sys.stderr, all_threads=True)


def capture(dump_folder: str, rank: int) -> str:
    """Sends this process's stderr to `path_for(dump_folder, rank)` as well, with faulthandler on it; returns
    the file's path. Call once per process, from the process's entry point only (it takes over fd 2)."""
    global _tee
    _native_messages_on()
    path = path_for(dump_folder, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tee = shutil.which("tee")
    if tee is None:
        faulthandler.enable(file=open(path, "a"), all_threads=True)  # noqa: SIM115 (held open by faulthandler)
        return path
    sys.stderr.flush()
    original = os.dup(2)
    _tee = subprocess.Popen([tee, "-a", path], stdin=subprocess.PIPE, stdout=original, start_new_session=True)
    os.dup2(_tee.stdin.fileno(), 2)  # sys.stderr writes to fd 2, so Python's output follows too
    faulthandler.enable(file=sys.stderr, all_threads=True)
    atexit.register(_drain, original)
    return path


def _drain(original: int) -> None:
    """At a normal exit (after Python printed any uncaught traceback): let tee write everything before this
    process is gone, so torchrun, which stops reading a rank's output when the rank exits, shows all of it."""
    sys.stderr.flush()
    os.dup2(original, 2)  # what is written from here on goes straight to the console
    _tee.stdin.close()  # tee sees the end of its input once every copy of the pipe is closed
    try:
        _tee.wait(timeout=5)  # sooner unless a child process (a compile worker) still holds the pipe
    except subprocess.TimeoutExpired:
        pass
