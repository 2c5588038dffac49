"""The restart supervisor's same-failure rule follows progress (tools/restart.py), on a stand-in command that
fails the same way every time (no torch: milliseconds per attempt): attempts that complete a newer checkpoint
than they resumed from never count towards the limit; attempts that do not, stop the run after the limit."""

import sys

from torchtitan.tools.restart import run_with_restarts

ATTEMPT = """
import os, sys
from torchtitan.tools.restart import record_failure, record_progress
attempt = int(os.environ["TORCHTITAN_ATTEMPT"])
if attempt:
    record_progress(resumed_from=10 * attempt)
if sys.argv[1] == "progress":
    record_progress(saved=10 * attempt + 10)
record_progress(resumed_from=0)  # a later reload (the guard's rollback) does not move the starting point
record_failure("RuntimeError: the same failure")
sys.exit(1)
"""


def supervise(mode, max_restarts, limit):
    lines = []
    code = run_with_restarts([sys.executable, "-c", ATTEMPT, mode], max_restarts, limit, log=lines.append)
    return code, lines


def test_failures_after_progress_are_restarted_until_the_budget_is_spent():
    code, lines = supervise("progress", max_restarts=5, limit=2)
    assert code == 1
    assert sum(line.startswith("restart: attempt") for line in lines) == 5, lines
    assert "restart budget (--max-restarts 5) is spent" in lines[-1]


def test_the_same_failure_without_progress_stops_at_the_limit():
    code, lines = supervise("stuck", max_restarts=5, limit=3)
    assert code == 1
    assert sum(line.startswith("restart: attempt") for line in lines) == 2, lines
    assert lines[-1].startswith("error: the run failed the same way 3 times in a row without progress")
