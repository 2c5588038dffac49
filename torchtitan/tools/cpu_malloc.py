"""How a CPU run's large tensors get their memory: glibc keeping freed blocks within a bound, on huge pages (or,
by choice, a preloaded size-class allocator).

A training step allocates and frees its large tensors every time (the [tokens x vocab] logits and their
gradient, the loss's float32 chunks, activations, gradients). glibc's malloc serves every block above its
mmap threshold (32 MiB at most, whatever mallopt is told) with a fresh mmap and unmaps it on free, so each
one is page-faulted in again, 4 KiB at a time. The remedies:

- **Huge pages (the default, `training.cpu_huge_pages`).** torch's CPU allocator, when the environment has
  THP_MEM_ALLOC_ENABLE=1 at its first CPU tensor, page-aligns every block of 2 MiB or more and asks the
  kernel for transparent huge pages on it (madvise): a fresh block faults in 2 MiB at a time, 512x fewer
  faults (a 64 MiB block: 143 ms -> 34 ms to allocate and fill, against 16 ms to fill kept memory). Alone, freed
  blocks still go back to the OS; with the kept heap below, only a step's first faults (and a trim's) remain. torch reads the variable once, and importing torch.distributed already
  allocates a tensor, so the entry point (torchtitan/train.py) sets it before anything else
  (`choose_at_start`): on machines without CUDA, where the kernel offers transparent huge pages, unless the
  environment already says otherwise. `--training.cpu_huge_pages false` restarts the process once without it
  (`respect_options`). GPU runs are untouched.
- **Returning every freed block (`memory.cpu_return_freed`, set by a memory budget).** glibc's mmap
  threshold is dynamic: each freed mmapped block raises it to that block's size (up to 32 MiB), after which
  blocks of that size come from the heap, whose freed middle is never returned: the process's resident memory
  then exceeds its live tensors (full AC at 16 thin blocks: 1.18 GiB against 0.67 GiB with the threshold
  fixed; docs/memory_budget.md). Fixing the threshold at its initial 128 KiB (`return_freed_memory`) turns the
  dynamic rule off, so every block above it is unmapped when freed and resident memory follows what the budget
  planner counts (at the price of faulting each such block in afresh).
- **Keeping freed memory, bounded (the default, `training.cpu_keep_freed_memory`).** With mmap off (M_MMAP_MAX
  0) large blocks come from the heap, and with the trim threshold at its maximum the freed heap is kept for the
  next step: no faults after the first step, as the CUDA caching allocator (1.2x a step at the 1B slice). Kept
  without bound, the heap fragments as shapes vary (a benchmark alternating four differently shaped variants grew
  past the machine's 24 GiB). `KeptHeap` bounds it: the trainer calls `after_step` once a step; the resident
  memory after the first `settle_steps` steps is the working set, and when a later step leaves more than
  `training.cpu_kept_heap_growth` above it, `malloc_trim(0)` hands every free page back to the OS (the next
  step faults them in again, once). `--memory.cpu_return_freed` (a memory budget) wins over it. `close()`
  puts glibc's thresholds back to their initial values, for a process that goes on after the trainer.

  The bound alone cannot stop the heap fragmenting when a step's shapes differ from the last one's (another
  sequence length, a validation pass): the kept blocks are sized for the other shapes, the coming step does not
  fit in their holes and grows the heap (the peak: 1.25x glibc's own over 300 steps of two alternating shapes).
  So `KeptHeap.before` returns every free page before a step whose shapes differ from the previous step's; a
  run of one shape (every training step but the last partial batch) keeps everything.
- **A preloaded allocator (`training.cpu_allocator mimalloc|jemalloc|tcmalloc`, by choice).** A library can
  only be preloaded before the process starts, so the entry point restarts itself once (same pid: torchrun
  keeps track) with LD_PRELOAD set (`respect_options`), unless the user preloaded an allocator already; the
  children a rank starts (tee, compile workers) get the user's LD_PRELOAD back. mimalloc (the `cmeel-mimalloc`
  wheel, `pip install -e ".[cpu]"`) returns memory that stays free for `MIMALLOC_PURGE_DELAY` ms: tighter
  memory than the kept heap but slower steps at the 1B slice (docs/performance.md), so it is not the default.

Only the process's CPU allocations change; numerics do not. No-op where the C library is not glibc or the
kernel has no transparent huge pages.
"""

import ctypes
import ctypes.util
import os
import sys

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # c10/core/impl/alloc_cpu.cpp; read once, at the first CPU tensor
_SET_HERE_ENV = "TORCHTITAN_THP_SET"  # marks a THP_MEM_ALLOC_ENABLE that choose_at_start set, not the user
_HUGE_PAGE = 2 * 2**20  # torch's threshold for huge pages when THP_MEM_ALLOC_ENABLE is set
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_GLIBC_TRIM_THRESHOLD = 128 * 2**10  # glibc's initial M_TRIM_THRESHOLD
_GLIBC_MMAP_MAX = 65536  # glibc's initial M_MMAP_MAX
_applied = False
_bound: "KeptHeap | None" = None
_returning = False


def kernel_thp_mode() -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never); None where it has none."""
    try:
        with open(_THP_SETTING) as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def choose_at_start() -> None:
    """Huge pages for torch's large CPU tensors, decided before the process's first CPU tensor: call it before
    importing anything that imports torch.distributed. Only where there is no CUDA (GPU runs are untouched),
    the kernel offers transparent huge pages, and THP_MEM_ALLOC_ENABLE is not set already (the user's value
    wins; 0 turns it off for this process)."""
    if HUGE_PAGES_ENV in os.environ or kernel_thp_mode() not in ("always", "madvise"):
        return
    import torch  # importing torch itself allocates no CPU tensor (torch.distributed does)

    if torch.cuda.is_available():
        return
    os.environ[HUGE_PAGES_ENV] = "1"
    os.environ[_SET_HERE_ENV] = "1"


ALLOCATORS = ("mimalloc", "jemalloc", "tcmalloc")  # what --training.cpu_allocator can preload, by name
_PRELOADED_ENV = "TORCHTITAN_CPU_ALLOCATOR"  # "name=path" this entry point preloaded; "glibc=" for none
_USER_PRELOAD_ENV = "TORCHTITAN_USER_LD_PRELOAD"  # the user's own LD_PRELOAD, given back to the rank's children
# mimalloc returns memory that stays free this long (ms; x10 for its arenas), its own default; measured
# (docs/performance.md): 1,000 kept 1.21x glibc's peak, 10 and 100 1.05x, 0 faults every block in again.
MIMALLOC_PURGE_DELAY_MS = "10"


def accelerator_present() -> bool:
    """Whether this machine has a GPU, judged without importing torch: the device files of NVIDIA's and AMD's
    drivers."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def find_allocator(name: str) -> str | None:
    """The library to preload for allocator `name`: mimalloc from the cmeel-mimalloc wheel of this Python
    environment first, else the system's library by its soname (LD_PRELOAD finds a name without a slash in
    the library path); None where it is not installed."""
    if name == "mimalloc":
        try:
            import importlib.metadata as md

            for f in md.distribution("cmeel-mimalloc").files or ():
                if f.name == "libmimalloc.so":
                    path = str(f.locate())
                    if os.path.exists(path):
                        return path
        except Exception:  # not installed, or installed without its file list
            pass
    for lib in (name, "tcmalloc_minimal") if name == "tcmalloc" else (name,):
        found = ctypes.util.find_library(lib)
        if found:
            return found
    return None


def _user_preload(environ=os.environ) -> str:
    """The user's own LD_PRELOAD, without the allocator this module added to it."""
    if _PRELOADED_ENV in environ:
        return environ.get(_USER_PRELOAD_ENV, "")
    return environ.get("LD_PRELOAD", "")


def user_preloaded_allocator() -> str | None:
    """The allocator the user's LD_PRELOAD already names (then this module preloads nothing), or None."""
    return next((n for n in ALLOCATORS if n in _user_preload()), None)


def wanted_allocator(choice: str, accelerator: bool, find=find_allocator) -> tuple[str, str] | None:
    """(name, library) to preload for `--training.cpu_allocator choice`, or None for glibc (the default, and on
    GPU machines, whose tensors are the GPU's). A named allocator that is not installed raises (pre-flight)."""
    if accelerator or choice == "glibc":
        return None
    path = find(choice)
    if path is None:
        raise ValueError(f"--training.cpu_allocator {choice}: no lib{choice} found (in this Python environment "
                         f"or the system's library path); install it (mimalloc: pip install cmeel-mimalloc) or "
                         f"use glibc")
    return choice, path


def preload_environment(preload: tuple[str, str] | None, environ: dict[str, str]) -> dict[str, str]:
    """`environ` for a process started with `preload` (name, library) in LD_PRELOAD, or with glibc; the user's
    own LD_PRELOAD stays behind it, and the choice is marked so that the entry point does not make it again."""
    user = _user_preload(environ)
    env = {k: v for k, v in environ.items() if k not in (_PRELOADED_ENV, _USER_PRELOAD_ENV, "LD_PRELOAD")}
    name, path = preload or ("glibc", "")  # glibc marked too: the choice is made
    env[_PRELOADED_ENV] = f"{name}={path}"
    env[_USER_PRELOAD_ENV] = user
    if path:
        env["LD_PRELOAD"] = ":".join(p for p in (path, user) if p)
        if name == "mimalloc":
            env.setdefault("MIMALLOC_PURGE_DELAY", MIMALLOC_PURGE_DELAY_MS)
    elif user:
        env["LD_PRELOAD"] = user
    return env


def _exec_with(preload: tuple[str, str] | None) -> None:
    """Restart this process (the same pid, so torchrun keeps track of it) with `preload` or glibc. The restarted
    process finds its choice marked and the huge-pages marker gone, so `respect_options` does not restart it
    again."""
    env = preload_environment(preload, dict(os.environ))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def _preloaded_here() -> tuple[str, str] | None:
    """(name, library) this module preloaded into this process; None for glibc (chosen, or never decided)."""
    name, _, path = os.environ.get(_PRELOADED_ENV, "").partition("=")
    return (name, path) if path else None


def respect_options(huge_pages: bool, allocator: str) -> None:
    """Once the options are read, in the rank's own process: restart it (once, the same pid) if they ask for
    other than what it runs: `--training.cpu_huge_pages false` after `choose_at_start` turned huge pages on
    (torch's choice cannot be undone in a running process), or another allocator than the one preloaded
    (`--training.cpu_allocator`). An allocator the user preloaded themselves is left alone. In the restarted
    process, the user's LD_PRELOAD goes back into the environment its children inherit."""
    restart = False
    if not huge_pages and os.environ.pop(_SET_HERE_ENV, None) is not None:
        os.environ[HUGE_PAGES_ENV] = "0"
        restart = True
    have = _preloaded_here()
    if user_preloaded_allocator() is None:
        wanted = wanted_allocator(allocator, accelerator_present())
        restart = restart or (wanted[0] if wanted else None) != (have[0] if have else None)
    else:
        wanted = have
    if restart:
        _exec_with(wanted)
    if _PRELOADED_ENV in os.environ:  # restarted by _exec_with: children get the user's LD_PRELOAD, not ours
        user = os.environ.get(_USER_PRELOAD_ENV, "")
        if user:
            os.environ["LD_PRELOAD"] = user
        else:
            os.environ.pop("LD_PRELOAD", None)


_MI_OPTION_PURGE_DELAY = 15  # mimalloc.h's mi_option_purge_delay


def mimalloc_purge_delay(ms: int) -> None:
    """Set mimalloc's purge delay in this running process (-1: never return freed memory); mimalloc must be
    loaded (benchmarks: the `tuned` variant)."""
    ctypes.CDLL(None).mi_option_set(_MI_OPTION_PURGE_DELAY, ctypes.c_long(ms))


def loaded_allocator() -> str | None:
    """The size-class allocator serving this process's malloc (mimalloc, jemalloc, tcmalloc: mapped into it,
    preloaded here or by the user), or None for glibc's."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    return next((n for n in ALLOCATORS if f"lib{n}" in maps), None)


def huge_pages_active() -> bool:
    """Whether torch's CPU allocator puts this process's large tensors on huge pages: only then does it align
    its blocks of 2 MiB or more to the page (else to 64 bytes, which glibc's mmapped blocks are 16 bytes past
    a page). A probe asks it rather than re-reading its settings; four blocks held at once, so that one
    page-aligned by chance cannot pass for it."""
    import torch

    if kernel_thp_mode() not in ("always", "madvise"):
        return False
    blocks = [torch.empty(_HUGE_PAGE + i * 4160, dtype=torch.uint8) for i in range(4)]
    return all(b.data_ptr() % _PAGE == 0 for b in blocks)


def describe() -> str:
    """The CPU allocator setting in effect, for the log."""
    name = loaded_allocator()
    if name is not None:
        here = _preloaded_here()
        how = (f"preloaded (--training.cpu_allocator; {here[1]})" if here is not None and here[0] == name
               else "preloaded by the environment's LD_PRELOAD")
        if name == "mimalloc":
            how += f", MIMALLOC_PURGE_DELAY={os.environ.get('MIMALLOC_PURGE_DELAY', MIMALLOC_PURGE_DELAY_MS)} ms"
        # huge_pages_active's alignment probe cannot tell under an allocator that page-aligns large blocks itself
        thp = os.environ.get(HUGE_PAGES_ENV) == "1" and kernel_thp_mode() in ("always", "madvise")
        return f"{name} {how}; tensors of 2 MiB or more on transparent huge pages: {'yes' if thp else 'no'}"
    kept = ""
    if _applied:
        kept = ("; glibc keeps large freed blocks, " + _bound.describe() if _bound is not None else
                "; glibc keeps large freed blocks without bound") + " (--training.cpu_keep_freed_memory)"
    if _returning:
        kept += "; glibc unmaps every freed block of 128 KiB or more (--memory.cpu_return_freed)"
    if huge_pages_active():
        return f"tensors of 2 MiB or more on transparent huge pages (--training.cpu_huge_pages){kept}"
    why = {
        None: "the kernel has no transparent huge pages",
        "never": "the kernel's transparent huge pages are off",
    }.get(kernel_thp_mode(), f"{HUGE_PAGES_ENV}={os.environ.get(HUGE_PAGES_ENV, 'unset')} at the first CPU tensor")
    return f"glibc malloc as it starts, no huge pages ({why}){kept}"


_GLIBC_MMAP_THRESHOLD = 128 * 2**10  # glibc's initial mmap threshold, before its dynamic raising


def return_freed_memory(threshold: int = _GLIBC_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes (its initial value; fixing it turns the dynamic raising
    off): every block that large is mmapped and unmapped when freed. True if it took effect, False where the C
    library is not glibc."""
    global _returning
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _returning = libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        return False
    return _returning


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to serve large blocks from the heap and keep what is freed; True if it took
    effect (now or in an earlier call), False where the C library is not glibc."""
    global _applied
    if _applied:
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # mallopt returns 1 on success; both settings or neither.
    _applied = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    return _applied


def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def malloc_trim() -> bool:
    """glibc's `malloc_trim(0)`: every whole free page of every arena (the heap's top and the free chunks inside
    it) goes back to the OS. True if it released anything; False where the C library is not glibc."""
    try:
        return _libc().malloc_trim(0) == 1
    except (OSError, AttributeError):
        return False


def restore_initial() -> None:
    """Undo `keep_freed_memory` (glibc's initial M_MMAP_MAX and M_TRIM_THRESHOLD; its dynamic mmap threshold
    stays off once set) and return the kept heap: a process that goes on after the trainer (tests, notebooks)
    does not keep the run's heap."""
    global _applied, _bound
    _bound = None
    if not _applied:
        return
    try:
        libc = _libc()
        libc.mallopt(_M_MMAP_MAX, _GLIBC_MMAP_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, _GLIBC_TRIM_THRESHOLD)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
    _applied = False


def _current_rss() -> int | None:
    # tools/memory has the same reader, but importing it imports torch; this module stays torch-free
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


class KeptHeap:
    """The bound on glibc's kept heap: `after_step()` once a training step (after its validation and save).
    The highest resident memory after the first `settle_steps` steps is the working set (the heap then holds
    a step's blocks); a later step that leaves more than `growth` (a fraction) above it has grown the heap by
    fragmentation (another shape, a validation pass), and `malloc_trim(0)` returns every free page. Plain
    state, no timing: `read_rss` and `trim` are injectable for tests."""

    def __init__(self, growth: float, settle_steps: int = 2, read_rss=_current_rss, trim=malloc_trim):
        self.growth, self.settle_steps = growth, settle_steps
        self.read_rss, self.trim = read_rss, trim
        self.steps, self.trims = 0, 0
        self.working_set = 0
        self.last_trim_freed = 0  # bytes of resident memory the last trim returned
        self.last_shapes = None  # the shapes of the last step `before` saw
        self.shape_trims = 0  # trims because the shapes changed

    @property
    def limit(self) -> float:
        """Resident bytes after a step above which the heap is trimmed (inf while settling)."""
        return self.working_set * (1 + self.growth) if self.steps >= self.settle_steps else float("inf")

    def after_step(self) -> bool:
        """Count a step; trim the heap if it grew past the limit. True if it trimmed."""
        rss = self.read_rss()
        if rss is None:
            return False
        self.steps += 1
        if self.steps <= self.settle_steps:
            self.working_set = max(self.working_set, rss)
            return False
        if rss <= self.limit:
            return False
        self.trim()
        self.trims += 1
        after = self.read_rss()
        self.last_trim_freed = rss - after if after is not None else 0
        return True

    def before(self, shapes) -> bool:
        """Call before each step (and validation pass) with its shapes (any comparable value). When they differ
        from the last call's, the kept blocks are sized for the other shapes: the coming step would fit around
        them and grow the heap (fragmentation), so every free page goes back first and the step faults in
        what it needs, once. The same shapes again keep everything. True if it trimmed."""
        changed = self.last_shapes is not None and shapes != self.last_shapes
        self.last_shapes = shapes
        if changed:
            self.trim()
            self.shape_trims += 1
        return changed

    def describe(self) -> str:
        return (f"returned (malloc_trim) before a step of other shapes than the last, and when a step leaves "
                f"resident memory {100 * self.growth:.0f}% above the first {self.settle_steps} steps'")


def keep_freed_memory_bounded(growth: float, settle_steps: int = 2) -> KeptHeap | None:
    """`keep_freed_memory` with its bound: the `KeptHeap` the trainer calls after each step, or None where the
    C library is not glibc."""
    global _bound
    if not keep_freed_memory():
        return None
    _bound = KeptHeap(growth, settle_steps)
    return _bound
