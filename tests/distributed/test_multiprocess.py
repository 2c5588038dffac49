"""tests/multiprocess.py: ranks forked from the fork server see the caller's environment and working directory
at the call (not the server's, from when it started), and each starts from a clean interpreter."""

import os

import pytest

from tests.multiprocess import run_ranks

pytestmark = pytest.mark.distributed


def _what_a_rank_sees(rank, world_size):
    import sys

    import torch.distributed as dist

    seen = (os.environ.get("TORCHTITAN_TEST_PROBE"), os.getcwd(), dist.get_world_size(),
            "tests.distributed.test_multiprocess" in sys.modules and hasattr(sys.modules["tests.multiprocess"], "_LEAK"))
    import tests.multiprocess as m

    m._LEAK = True  # a module attribute set here must not reach the next call's ranks
    return seen


def test_ranks_see_the_callers_environment_and_cwd_and_start_clean(monkeypatch, tmp_path):
    for value in ("first", "second"):  # the second call: after the server started, with other values
        monkeypatch.setenv("TORCHTITAN_TEST_PROBE", value)
        folder = tmp_path / value
        folder.mkdir()
        monkeypatch.chdir(folder)
        seen = run_ranks(_what_a_rank_sees, 2)
        assert seen == [(value, str(folder), 2, False)] * 2, seen
