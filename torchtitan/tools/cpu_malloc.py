"""Keep large freed blocks in the process on CPU runs, instead of handing each one back to the OS.

glibc's malloc serves every block above its mmap threshold (32 MiB at most, whatever mallopt is told) with
a fresh mmap and unmaps it on free. A training step allocates and frees its large tensors every time (the
[tokens x vocab] logits and their gradient, the loss's float32 chunks, activations, gradients), so each
one is page-faulted in again, 4 KiB at a time, and the kernel zeroes every page: on a 2-core AMD EPYC
a 1B-shaped slice's step took 21.1 s without and 15.1 s with this setting (docs/performance.md, "MFU at a
1B-shaped Llama slice"). With mmap off (M_MMAP_MAX 0) large blocks come
from the heap, and with the trim threshold at its maximum the freed heap is kept for the next step: after
the first step the process holds its peak and reuses it, which is what the CUDA caching allocator does on
GPUs. The cost is that the process does not shrink between steps (its peak RSS is what it keeps).

Only the process's CPU allocations change; no-op where the C library is not glibc (musl, macOS), and the
trainer applies it only when it trains on the CPU and `training.cpu_keep_freed_memory` is set (off by
default: the kept heap fragments, and a benchmark alternating four differently shaped variants grew past
the machine's 24 GiB with it).
"""

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # <malloc.h>
_M_MMAP_MAX = -4
_applied = False


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
