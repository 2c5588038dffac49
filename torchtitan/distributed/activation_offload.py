"""Activation offload: what a transformer block saves for backward moves to a slower tier during forward and
comes back ahead of the backward that needs it.

A block chosen for offload (`--memory.block_choices`, or the budget planner) is wrapped in `OffloadedBlock`.
Its forward runs under `torch.autograd.graph.saved_tensors_hooks`: every tensor autograd saves inside the block
(except the block's parameters, which stay resident anyway and which FSDP frees and regathers by itself) is
replaced by a small handle, and the block's saved storages are written out as one group. In backward, the first
time a group is needed it is read back (waiting if the read is not done), and the group saved just before it in
forward (the next one backward will need) is prefetched.

Tiers:
  FileTier     CPU, where host RAM is the limit: one file per group in a local directory, written and read by
               one background thread, so the process's resident memory really falls while a block's saved
               tensors are on disk. The page cache is told to drop the written pages (posix_fadvise).
  PinnedHost   CUDA: pinned host buffers, copies on a side stream overlapped with compute (device -> host after
               the block's forward, host -> device when prefetched); the compute stream waits on an event only
               when it needs the tensors.

Memory: with prefetch (the default) a group is written while the next block runs its forward, and at the end
of each offloaded block the forward waits for the previous group's write, so at most two groups are resident
during forward; in backward the group in use and the one being prefetched. Without prefetch
(--memory.offload_prefetch false) each block waits for its own write and reads its group when backward needs
it: one group resident, the moves exposed. The planner counts two groups or one (planning/memory_budget.py).

Numbers: the bytes come back exactly, into storages with the same offsets, sizes and strides (views keep
sharing one storage), so backward runs the same kernels on the same values: losses are bitwise equal to the
run without offload (tests/unit/test_activation_offload.py).

Compile: the wrapper stays outside the compiled region (apply_compile compiles the wrapped block); a compiled
block's saved tensors still pass through the hooks when it runs.
"""

import os
import shutil
import tempfile
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
from torch.distributed.tensor import DTensor

_ALIGN = 64
"""Byte alignment of each storage inside a group's buffer (any dtype's element size divides it)."""


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class FileTier:
    """Groups of storages in files under one private directory, moved by one background thread."""

    def __init__(self, directory: str = ""):
        self.dir = tempfile.mkdtemp(prefix="torchtitan-offload-", dir=directory or None)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="activation-offload")
        self._count = 0
        # The directory goes with the tier (or at exit): files of groups never read back go with it.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    def holds(self, t: torch.Tensor) -> bool:
        return True  # a CPU run's tensors, all of them

    def write(self, storages: list[torch.UntypedStorage]) -> tuple[Future, int]:
        """Starts writing `storages` (in this order) to a new file; returns (a future of its path, the bytes)."""
        self._count += 1
        path = os.path.join(self.dir, f"group-{self._count}")
        total = sum(_aligned(s.nbytes()) for s in storages)
        return self._pool.submit(self._write, path, storages), total

    @staticmethod
    def _write(path: str, storages: list[torch.UntypedStorage]) -> str:
        with open(path, "wb") as f:
            for s in storages:
                n = s.nbytes()
                f.write(memoryview(_bytes_view(s).numpy()))
                f.write(b"\0" * (_aligned(n) - n))
            f.flush()
            # Start writing the pages back and let the kernel drop them from the page cache once clean; no
            # fsync: the process's memory is released when the bytes are in the file, durability is not needed.
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        storages.clear()  # the resident copies are released here, once on disk
        return path

    def read(self, written: Future, nbytes: int) -> Future:
        """Starts reading a group back; the future gives one uint8 buffer of `nbytes`."""
        return self._pool.submit(self._read, written, nbytes)

    @staticmethod
    def _read(written: Future, nbytes: int) -> torch.Tensor:
        path = written.result()
        buf = torch.empty(nbytes, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(buf.numpy()), 0
            while done < nbytes:
                done += f.readinto(view[done:])
        os.remove(path)
        return buf

    def discard(self, written: Future) -> None:
        written.add_done_callback(lambda f: os.path.exists(f.result()) and os.remove(f.result()))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._cleanup()


class _Done(Future):
    def __init__(self, value):
        super().__init__()
        self.set_result(value)


class PinnedHostTier:
    """CUDA: groups copied to pinned host memory on a side stream and back ahead of their backward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def holds(self, t: torch.Tensor) -> bool:
        # Tensors autograd saves on the host (a CPU RNG state, an index built there) are in host memory already:
        # they stay where they are (copying them on a CUDA stream is not possible: record_stream is CUDA's).
        return t.device.type == "cuda"

    def write(self, storages: list[torch.UntypedStorage]) -> tuple[Future, int]:
        total = sum(_aligned(s.nbytes()) for s in storages)
        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the block's forward produced them on the compute stream
        with torch.cuda.stream(self.stream):
            offset = 0
            for s in storages:
                src = _bytes_view(s)
                host[offset: offset + src.numel()].copy_(src, non_blocking=True)
                src.record_stream(self.stream)  # the allocator must not reuse them before the copy is done
                offset += _aligned(s.nbytes())
        done = torch.cuda.Event()
        done.record(self.stream)
        storages.clear()
        return _Done((host, done)), total

    def read(self, written: Future, nbytes: int) -> Future:
        host, wrote = written.result()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(wrote)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            buf.copy_(host, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(self.stream)
        return _Done((buf, ready))

    def discard(self, written: Future) -> None:
        pass

    def close(self) -> None:
        pass


class _Group:
    """The saved storages of one forward of one offloaded block."""

    def __init__(self, offloader: "ActivationOffloader"):
        self.offloader = offloader
        self.index: dict[int, int] = {}  # storage data_ptr -> position in `storages`
        self.storages: list[torch.UntypedStorage] = []
        self.offsets: list[int] = []
        self.nbytes = 0
        self.written: Future | None = None
        self.loaded: Future | None = None
        self.buffer: torch.Tensor | None = None
        self.handles = 0

    def add(self, storage: torch.UntypedStorage) -> int:
        key = storage.data_ptr()
        if key not in self.index:
            self.index[key] = len(self.storages)
            self.offsets.append(self.nbytes)
            self.storages.append(storage)
            self.nbytes += _aligned(storage.nbytes())
        return self.index[key]

    def prefetch(self) -> None:
        if self.loaded is None and self.written is not None:
            self.loaded = self.offloader.tier.read(self.written, self.nbytes)

    def get_buffer(self) -> torch.Tensor:
        if self.buffer is None:
            self.prefetch()
            result = self.loaded.result()
            if isinstance(result, tuple):  # CUDA: (buffer, event); the compute stream waits for the copy
                result, ready = result
                torch.cuda.current_stream(result.device).wait_event(ready)
            self.buffer = result
            self.offloader.on_first_use(self)
        return self.buffer

    def release_handle(self) -> None:
        self.handles -= 1
        if self.handles == 0:
            self.offloader.forget(self)


class _Saved:
    """What autograd keeps instead of an offloaded tensor."""

    __slots__ = ("group", "slot", "dtype", "size", "stride", "offset", "__weakref__")

    def __init__(self, group: _Group, slot: int, t: torch.Tensor):
        self.group, self.slot = group, slot
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.size(), t.stride(), t.storage_offset()
        group.handles += 1
        weakref.finalize(self, group.release_handle)

    def tensor(self) -> torch.Tensor:
        buf = self.group.get_buffer()
        start = self.group.offsets[self.slot]
        elem = torch.empty((), dtype=self.dtype).element_size()
        return torch.empty(0, dtype=self.dtype, device=buf.device).set_(
            buf.untyped_storage(), start // elem + self.offset, self.size, self.stride
        )


class ActivationOffloader:
    """The groups of every offloaded block of one model part, in forward order, and the tier they go to."""

    def __init__(self, tier, prefetch: bool = True):
        self.tier = tier
        self.prefetch = prefetch
        self.groups: list[_Group] = []  # alive, in the order they were created
        self._lock = threading.Lock()

    def run(self, block: nn.Module, *args, **kwargs):
        """Runs `block`'s forward with its saved tensors offloaded."""
        group = _Group(self)
        skip = {_storage(p).data_ptr() for p in block.parameters()}

        def pack(t: torch.Tensor):
            # Under TP autograd saves DTensors: their local tensor goes, their sharding spec stays.
            local = t._local_tensor if isinstance(t, DTensor) else t
            if (type(local) is not torch.Tensor or local.device.type == "meta"  # other subclasses stay
                    or not self.tier.holds(local)
                    or _storage(local).data_ptr() in skip or _storage(local).nbytes() == 0):
                return t
            saved = _Saved(group, group.add(_storage(local)), local)
            return (saved, t._spec, t.requires_grad) if isinstance(t, DTensor) else saved

        def unpack(h):
            if isinstance(h, tuple):
                saved, spec, requires_grad = h
                return DTensor(saved.tensor(), spec, requires_grad=requires_grad)
            return h.tensor() if isinstance(h, _Saved) else h

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            out = block(*args, **kwargs)
        if group.storages:
            previous = [g for g in self.groups if g.written is not None]
            group.written, _ = self.tier.write(group.storages)
            with self._lock:
                self.groups.append(group)
            if not self.prefetch:  # one group resident: this block waits for its own write
                group.written.result()
            elif previous:  # at most two groups resident: this one (being written) and the next block's
                previous[-1].written.result()
        return out

    def on_first_use(self, group: _Group) -> None:
        """Backward reached `group`: prefetch the group saved before it, the next one backward needs."""
        with self._lock:
            i = self.groups.index(group)
            earlier = self.groups[i - 1] if i > 0 else None
        if earlier is not None and self.prefetch:
            earlier.prefetch()

    def forget(self, group: _Group) -> None:
        with self._lock:
            if group in self.groups:
                self.groups.remove(group)
        if group.loaded is None and group.written is not None:
            self.tier.discard(group.written)  # never read back (e.g. forward without backward)
        group.buffer = None

    def close(self) -> None:
        self.tier.close()


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()


class OffloadedBlock(ActivationWrapper):
    """A transformer block whose saved activations are offloaded. Parameter names and attribute access are
    the wrapped block's (torch's ActivationWrapper strips its prefix, as checkpoint_wrapper does)."""

    def __init__(self, block: nn.Module, offloader: ActivationOffloader):
        super().__init__(block)
        self.offloader = offloader

    @property
    def compile_target(self) -> nn.Module:
        """What apply_compile compiles: the block, so the hooks stay outside the compiled graph."""
        return self._checkpoint_wrapped_module

    def forward(self, *args, **kwargs):
        return self.offloader.run(self._checkpoint_wrapped_module, *args, **kwargs)


def make_tier(device: torch.device, directory: str = ""):
    """The offload tier for a device: pinned host memory under CUDA, files elsewhere."""
    if device.type == "cuda":
        return PinnedHostTier(device)
    return FileTier(directory)


def measure_file_bandwidth(directory: str = "", nbytes: int = 256 * 2**20) -> tuple[float, float]:
    """(write, read) bytes per second of the file tier in `directory`, moving `nbytes` once each way
    through the same code path the offload uses."""
    import time

    tier = FileTier(directory)
    try:
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        start = time.perf_counter()
        written, total = tier.write([data.untyped_storage()])
        written.result()
        w = time.perf_counter() - start
        start = time.perf_counter()
        back = tier.read(written, total).result()
        r = time.perf_counter() - start
        assert torch.equal(back[:nbytes], data)
        return nbytes / w, nbytes / r
    finally:
        tier.close()
