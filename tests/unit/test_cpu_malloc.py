"""tools/cpu_malloc.py: with glibc, a large block freed and allocated again is served from memory the process
kept, not page-faulted in afresh; the trainer applies it on CPU when told to. The entry point puts torch's
large CPU tensors on transparent huge pages by default, says so in the log, and one option turns it off."""

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


def test_entry_point_uses_huge_pages_by_default_and_the_option_turns_them_off(tmp_path):
    """`python -m torchtitan.train` (as torchrun starts each rank) on a CPU: the log's allocator line says
    huge pages, read back from torch's allocator (a 2 MiB-aligned probe), not from the setting; with
    `--training.cpu_huge_pages false` the process restarts once and the same probe says they are off (the
    negative control: a probe that always said yes would fail here)."""
    import os

    from tests.unit.checkpoint_helpers import TINY
    from torchtitan.tools import cpu_malloc

    if cpu_malloc.kernel_thp_mode() not in ("always", "madvise"):
        pytest.skip("the kernel has no transparent huge pages to ask for")
    env = {k: v for k, v in os.environ.items() if k not in (cpu_malloc.HUGE_PAGES_ENV, "TORCHTITAN_THP_SET")}
    env["OMP_NUM_THREADS"] = "1"
    lines = {}
    for flag in ("true", "false"):
        out = subprocess.run(
            [sys.executable, "-m", "torchtitan.train", *TINY, "--training.steps", "1",
             "--job.dump_folder", str(tmp_path / flag), "--training.cpu_huge_pages", flag],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        lines[flag] = [line for line in out.stdout.splitlines() if "CPU allocator:" in line]
        assert len(lines[flag]) == 1, out.stdout[-3000:]  # one line, even across the restart
    assert "tensors of 2 MiB or more on transparent huge pages" in lines["true"][0], lines
    assert "no huge pages (THP_MEM_ALLOC_ENABLE=0 at the first CPU tensor)" in lines["false"][0], lines


# Resident MiB left after 64 blocks of 4 MiB are allocated and all but the last freed, once an 8 MiB mmapped
# block has been freed (which raises glibc's dynamic mmap threshold to 8 MiB, so the 4 MiB blocks come from a
# heap that cannot shrink below its last live block), with glibc's default and with the threshold fixed.
_RETURN_PROBE = """
import sys
sys.path.insert(0, {root!r})
from torchtitan.tools import cpu_malloc
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
if {fixed}:
    assert cpu_malloc.return_freed_memory()
big = bytearray(8 * 2**20)
del big
base = rss()
blocks = [bytearray(4 * 2**20) for _ in range(64)]
last = blocks[-1]
del blocks
print((rss() - base) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_return_freed_memory_keeps_resident_memory_to_the_live_blocks():
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    kept = [float(subprocess.run([sys.executable, "-c", _RETURN_PROBE.format(root=root, fixed=f)], text=True,
                                 capture_output=True, check=True).stdout) for f in (False, True)]
    assert kept[0] > 200 and kept[1] < 16, kept  # glibc's dynamic threshold keeps ~252 MiB freed; fixed: ~4
