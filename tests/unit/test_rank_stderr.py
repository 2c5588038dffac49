"""A rank that dies of a signal names itself (tools/rank_stderr.py, issue 31): its Python stacks (faulthandler,
every thread) and the C library's own message reach both its stderr and `{dump}/ranks/rank-N.stderr`.

Each case is a fresh interpreter that calls `capture` as the entry point does, then dies: os.abort() in a
named function on a second thread (SIGABRT, what the CP run died of), and glibc's abort on freeing a pointer
it never gave out (the message glibc writes to /dev/tty unless LIBC_FATAL_STDERR_ is set). Negative control:
without `capture` the file does not exist and the stack still reaches stderr (faulthandler from enable_early),
so the file's content comes from capture and nothing else. ~1 s a case."""

import signal
import subprocess
import sys
import textwrap

import pytest

from torchtitan.tools.rank_stderr import path_for

ABORT_IN_THREAD = """
    import os, threading, time
    def rank_worker_that_aborts():
        time.sleep(0.05)
        os.abort()
    threading.Thread(target=rank_worker_that_aborts, name="worker").start()
    time.sleep(30)
"""
BAD_FREE = """
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    libc.free.argtypes = [ctypes.c_void_p]
    buf = ctypes.create_string_buffer(64)
    libc.free(ctypes.addressof(buf) + 16)  # not a pointer malloc gave out: glibc aborts
"""


def _die(tmp_path, body: str, capture: bool) -> subprocess.CompletedProcess:
    setup = (f"rank_stderr.capture({str(tmp_path)!r}, 1)" if capture else "")
    code = f"from torchtitan.tools import rank_stderr\nrank_stderr.enable_early()\n{setup}\n" + textwrap.dedent(body)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env,
                          start_new_session=True)


def test_abort_on_a_thread_leaves_every_stack_in_stderr_and_the_rank_file(tmp_path):
    p = _die(tmp_path, ABORT_IN_THREAD, capture=True)
    assert p.returncode == -signal.SIGABRT
    for text in (p.stderr, open(path_for(str(tmp_path), 1)).read()):
        assert "Fatal Python error: Aborted" in text, text
        assert "rank_worker_that_aborts" in text, text  # the aborting thread's frame
        assert "Current thread" in text and text.count("Thread 0x") >= 1, text  # and the main thread too


def test_glibc_heap_abort_message_reaches_the_rank_file(tmp_path):
    p = _die(tmp_path, BAD_FREE, capture=True)
    assert p.returncode == -signal.SIGABRT
    text = open(path_for(str(tmp_path), 1)).read()
    assert "free(): invalid pointer" in text and "Fatal Python error: Aborted" in text, text
    assert "free(): invalid pointer" in p.stderr


def test_without_capture_there_is_no_rank_file(tmp_path):
    p = _die(tmp_path, ABORT_IN_THREAD, capture=False)
    assert p.returncode == -signal.SIGABRT and "rank_worker_that_aborts" in p.stderr
    with pytest.raises(FileNotFoundError):
        open(path_for(str(tmp_path), 1))


def test_an_uncaught_exception_reaches_both_before_the_process_is_gone(tmp_path):
    """The normal exit path (capture drains tee there, as torchrun stops reading a rank when it exits)."""
    p = _die(tmp_path, "raise RuntimeError('boom at exit')", capture=True)
    assert p.returncode == 1
    for text in (p.stderr, open(path_for(str(tmp_path), 1)).read()):
        assert "Traceback" in text and "RuntimeError: boom at exit" in text, text
