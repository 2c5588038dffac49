"""The trainer's entry point turns on the CUDA caching allocator's expandable segments unless the user
configured the allocator (tools/cuda_alloc.py)."""

import subprocess
import sys

from torchtitan.tools import cuda_alloc


def test_expandable_segments_by_default_and_the_users_setting_wins():
    env = {}
    assert cuda_alloc.choose_at_start(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for name in cuda_alloc.ALLOC_CONF_ENVS:  # either name, whatever its value, is the user's choice
        env = {name: "expandable_segments:False"}
        assert not cuda_alloc.choose_at_start(env)
        assert env == {name: "expandable_segments:False"}


def test_entry_point_sets_it():
    """`python -m torchtitan.train` sets it in its `__main__` block, before importing the trainer (which
    imports torch.distributed): the rank's environment has it by the time any CUDA allocation could happen."""
    probe = ("import runpy, sys, os; sys.argv = ['torchtitan.train', '--help']\n"
             "try:\n    runpy.run_module('torchtitan.train', run_name='__main__')\n"
             "except SystemExit:\n    pass\n"
             "print('CONF=' + os.environ.get('PYTORCH_CUDA_ALLOC_CONF', ''))")
    env = {k: v for k, v in __import__("os").environ.items() if k not in cuda_alloc.ALLOC_CONF_ENVS}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "CONF=expandable_segments:True", out.stdout[-2000:]
