"""tools/cpu_malloc.py: with glibc, a large block freed and allocated again is served from memory the process
kept, not page-faulted in afresh; the trainer applies it on CPU unless told not to."""

import subprocess
import sys

import pytest

# Minor page faults of the second of two 64 MiB allocations, each filled then freed (bytearray takes malloc's
# path: above the mmap threshold, a fresh mmap every time unless the setting keeps freed memory).
_PROBE = """
import resource, sys
sys.path.insert(0, {root!r})
from torchtitan.tools import cpu_malloc
def faults_of_one_block():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = bytearray(64 * 2**20)  # zero-filled: every page is touched
    del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_block()
plain = faults_of_one_block()
applied = cpu_malloc.keep_freed_memory()
faults_of_one_block()  # the first block after the change still grows the heap
kept = faults_of_one_block()
print(applied, plain, kept)
"""


def test_freed_large_blocks_are_reused_instead_of_faulted_in_again():
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PROBE.format(root=root)], capture_output=True, text=True, check=True)
    applied, plain, kept = out.stdout.split()
    if applied != "True":
        pytest.skip("the C library is not glibc: nothing to set")
    pages = 64 * 2**20 // 4096
    assert int(plain) > pages // 2, out.stdout  # glibc unmapped the block: every page faulted in again
    assert int(kept) < pages // 20, out.stdout  # kept: the same pages, no new faults


def test_trainer_applies_it_on_cpu_only_when_enabled(monkeypatch):
    from torchtitan.tools import cpu_malloc
    import torchtitan.trainer as trainer_module

    calls = []
    monkeypatch.setattr(cpu_malloc, "keep_freed_memory", lambda: calls.append(1) or True)
    from tests.unit.checkpoint_helpers import TINY
    from torchtitan.protocols.train_spec import config_manager

    for flag, expected in (("true", 1), ("false", 0)):
        calls.clear()
        cfg = config_manager().parse_args([*TINY, "--training.steps", "1", "--training.cpu_keep_freed_memory", flag])
        trainer = trainer_module.Trainer(cfg)
        trainer.close()
        assert len(calls) == expected, flag
