"""tools/cpu_malloc.py: with glibc, a large block freed and allocated again is served from memory the process
kept, not page-faulted in afresh, within a bound (a step that grows the kept heap past it trims it); the trainer
applies it on CPU by default and one option turns it off. The entry point puts torch's
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


def test_trainer_keeps_the_heap_bounded_by_default_and_one_option_turns_it_off(monkeypatch):
    """CPU runs keep freed memory within the bound by default (the bound checked once a step, after the step's
    save); `--training.cpu_keep_freed_memory false` turns it off; a memory budget's `--memory.cpu_return_freed`
    wins over it; close() hands the process's allocator back as glibc starts."""
    from torchtitan.tools import cpu_malloc
    import torchtitan.trainer as trainer_module

    class CountingBound:
        def __init__(self, growth):
            self.growth, self.steps, self.trims, self.last_trim_freed = growth, 0, 0, 0
            self.shapes = []

        def before(self, shapes):
            self.shapes.append(shapes)
            return False

        def after_step(self):
            self.steps += 1
            return False

    made, restored, returned = [], [], []
    monkeypatch.setattr(cpu_malloc, "keep_freed_memory_bounded", lambda g: made.append(CountingBound(g)) or made[-1])
    monkeypatch.setattr(cpu_malloc, "restore_initial", lambda: restored.append(1))
    monkeypatch.setattr(cpu_malloc, "return_freed_memory", lambda: returned.append(1) or True)
    from tests.unit.checkpoint_helpers import TINY
    from torchtitan.protocols.train_spec import config_manager

    cases = {(): (1, 0), ("--training.cpu_keep_freed_memory", "false"): (0, 0),
             ("--memory.cpu_return_freed", "true"): (0, 1)}
    for extra, (kept, unmapped) in cases.items():
        made.clear(), restored.clear(), returned.clear()
        cfg = config_manager().parse_args([*TINY, "--training.steps", "3", "--training.cpu_kept_heap_growth", "0.25",
                                           *extra])
        trainer = trainer_module.Trainer(cfg)
        if extra == ():
            trainer.train()
            assert made[0].growth == 0.25 and made[0].steps == 3, vars(made[0])  # once a step
            assert len(made[0].shapes) == 3 and made[0].shapes[0][0] == "train", made[0].shapes  # before each
        trainer.close()
        assert (len(made), len(returned), len(restored)) == (kept, unmapped, kept), extra


def test_kept_heap_trims_only_when_a_step_grows_past_the_settled_working_set():
    """The bound's rule alone (resident bytes injected): the first steps set the working set (their highest),
    a later step more than `growth` above it trims, one at or under it does not."""
    from torchtitan.tools.cpu_malloc import KeptHeap

    rss = iter([100, 120,  # settling: working set 120, limit 132
                130, 132, 140, 90,  # 140 > 132 trims (then 90 read back); 130 and 132 do not
                131, 200, 100, 50])  # 200 trims again; the limit stays the settled one
    trims = []
    heap = KeptHeap(0.10, settle_steps=2, read_rss=lambda: next(rss), trim=lambda: trims.append(1))
    did = [heap.after_step() for _ in range(7)]
    assert did == [False, False, False, False, True, False, True], did
    assert heap.working_set == 120 and heap.trims == 2 == len(trims) and heap.last_trim_freed == 100


# Resident MiB above the start after a heap is kept at 64 MiB, then grown by 192 MiB of blocks that are freed:
# with the bound (growth 0.5 of the settled heap) the step that grew it trims, unbounded it stays.
_BOUND_PROBE = """
import sys
sys.path.insert(0, {root!r})
from torchtitan.tools import cpu_malloc
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
base = rss()
if {bounded}:
    heap = cpu_malloc.keep_freed_memory_bounded(0.5, settle_steps=1)
else:
    assert cpu_malloc.keep_freed_memory()
    heap = cpu_malloc.KeptHeap(0.5, settle_steps=1, trim=lambda: None)  # the rule without its trim
block = bytearray(64 * 2**20); del block
heap.after_step()  # settles on the kept 64 MiB
blocks = [bytearray(64 * 2**20) for _ in range(4)]; del blocks
print(heap.after_step(), (rss() - base) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_bounded_heap_returns_what_grew_and_unbounded_keeps_it():
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    runs = [subprocess.run([sys.executable, "-c", _BOUND_PROBE.format(root=root, bounded=b)], text=True,
                           capture_output=True, check=True).stdout.split() for b in (True, False)]
    (trimmed, bounded), (_, unbounded) = runs
    assert trimmed == "True" and float(bounded) < 32, runs  # the kept 256 MiB returned
    assert float(unbounded) > 200, runs  # the negative control: without the trim the heap keeps it


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
    for flag in ("true", "false"):  # under glibc, whose blocks are page-aligned only on huge pages
        out = subprocess.run(
            [sys.executable, "-m", "torchtitan.train", *TINY, "--training.steps", "1", "--training.cpu_allocator",
             "glibc", "--job.dump_folder", str(tmp_path / flag), "--training.cpu_huge_pages", flag],
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


def test_entry_point_preloads_the_named_allocator_and_keeps_glibc_by_default(tmp_path):
    """`python -m torchtitan.train --training.cpu_allocator mimalloc` on a CPU machine restarts the rank once
    with mimalloc preloaded (pip install -e ".[cpu]"; the test extra installs it), in one restart with
    huge pages off; the log's allocator line says what serves the process's malloc, read from its memory map
    (the negative control: the default run, which must say glibc)."""
    import os

    from tests.unit.checkpoint_helpers import TINY
    from torchtitan.tools import cpu_malloc

    if cpu_malloc.accelerator_present():
        pytest.skip("a GPU machine: the allocator is left alone")
    assert cpu_malloc.find_allocator("mimalloc"), "the test extra installs cmeel-mimalloc: pip install -e .[test]"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHTITAN_", "MIMALLOC_"))}
    env.update(OMP_NUM_THREADS="1", LD_PRELOAD="")
    lines = {}
    for name, extra in {"default": [], "mimalloc": ["--training.cpu_allocator", "mimalloc",
                                                    "--training.cpu_huge_pages", "false"]}.items():
        out = subprocess.run([sys.executable, "-m", "torchtitan.train", *TINY, "--training.steps", "1",
                              "--job.dump_folder", str(tmp_path / name), *extra],
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        lines[name] = [line for line in out.stdout.splitlines() if "CPU allocator:" in line]
        assert len(lines[name]) == 1, out.stdout[-3000:]  # one line, even across the restart
    assert "mimalloc preloaded (--training.cpu_allocator" in lines["mimalloc"][0], lines
    assert f"MIMALLOC_PURGE_DELAY={cpu_malloc.MIMALLOC_PURGE_DELAY_MS} ms" in lines["mimalloc"][0], lines
    assert "transparent huge pages: no" in lines["mimalloc"][0], lines
    assert "mimalloc" not in lines["default"][0] and "glibc keeps large freed blocks" in lines["default"][0], lines


def test_allocator_choice_rules(monkeypatch):
    """What each --training.cpu_allocator value preloads: glibc nothing, a named allocator its library, GPU
    machines nothing; one that is not installed is one line in pre-flight."""
    from torchtitan.tools import cpu_malloc

    find = {"mimalloc": "/lib/libmimalloc.so", "jemalloc": "libjemalloc.so.2"}.get
    assert cpu_malloc.wanted_allocator("glibc", False, find) is None
    assert cpu_malloc.wanted_allocator("mimalloc", False, find) == ("mimalloc", "/lib/libmimalloc.so")
    assert cpu_malloc.wanted_allocator("jemalloc", False, find) == ("jemalloc", "libjemalloc.so.2")
    assert cpu_malloc.wanted_allocator("mimalloc", True, find) is None  # a GPU machine
    with pytest.raises(ValueError, match="--training.cpu_allocator tcmalloc: no libtcmalloc found.*use glibc"):
        cpu_malloc.wanted_allocator("tcmalloc", False, find)

    from tests.unit.checkpoint_helpers import TINY
    from torchtitan.job_checks import check_job_values
    from torchtitan.protocols.train_spec import config_manager

    monkeypatch.setattr(cpu_malloc, "find_allocator", lambda name: None)
    with pytest.raises(ValueError, match="--training.cpu_allocator jemalloc: no libjemalloc found"):
        check_job_values(config_manager().parse_args([*TINY, "--training.cpu_allocator", "jemalloc"]))
    check_job_values(config_manager().parse_args(list(TINY)))  # the default needs no library


def test_kept_heap_returns_everything_before_a_step_of_other_shapes():
    """`before(shapes)`: the same shapes again keep the heap; other shapes (another sequence length, a
    validation pass) trim it first, once per change; the first step has nothing to return."""
    from torchtitan.tools.cpu_malloc import KeptHeap

    trims = []
    heap = KeptHeap(0.1, read_rss=lambda: 100, trim=lambda: trims.append(1))
    calls = [(1, 2048), (1, 2048), (1, 1024), (1, 1024), ("validation",), (1, 2048)]
    assert [heap.before(c) for c in calls] == [False, False, True, False, True, True]
    assert len(trims) == heap.shape_trims == 3 and heap.trims == 0


def test_preload_environment_keeps_the_users_preload_and_marks_the_choice():
    """The environment a restart gets: the allocator in front of the user's own LD_PRELOAD, the choice marked
    (glibc too, so that the restarted start does not preload again), mimalloc's purge delay unless the user set
    one; going back to glibc gives the user's LD_PRELOAD back unchanged."""
    from torchtitan.tools import cpu_malloc

    user = {"LD_PRELOAD": "/opt/mine.so", "KEEP": "1"}
    mi = cpu_malloc.preload_environment(("mimalloc", "/lib/libmimalloc.so"), user)
    assert mi["LD_PRELOAD"] == "/lib/libmimalloc.so:/opt/mine.so" and mi["KEEP"] == "1"
    assert mi["MIMALLOC_PURGE_DELAY"] == cpu_malloc.MIMALLOC_PURGE_DELAY_MS
    assert cpu_malloc.preload_environment(("mimalloc", "/l.so"), {"MIMALLOC_PURGE_DELAY": "7"})["MIMALLOC_PURGE_DELAY"] == "7"
    back = cpu_malloc.preload_environment(None, mi)
    assert back["LD_PRELOAD"] == "/opt/mine.so" and back["TORCHTITAN_CPU_ALLOCATOR"] == "glibc="
    assert "LD_PRELOAD" not in cpu_malloc.preload_environment(None, {})
    again = cpu_malloc.preload_environment(("jemalloc", "libjemalloc.so.2"), back)  # from a restarted process
    assert again["LD_PRELOAD"] == "libjemalloc.so.2:/opt/mine.so"
