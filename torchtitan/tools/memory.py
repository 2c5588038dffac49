"""Per-rank memory statistics for the metrics log.

CUDA (and ROCm, which torch exposes as cuda): the caching allocator's peaks since the last log window, as GiB and
as % of the device's capacity, plus the counts (since start) of allocation retries and OOMs, the signs of
fragmentation and memory pressure.
CPU: the process's resident set size (RSS), which counts everything the process holds, not only tensors.
"""

import os
import resource
import sys

import torch

_GIB = 1024**3


def _current_rss_bytes() -> float | None:
    """Resident set size now, from /proc (Linux); None where /proc is not available."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> float:
    """Peak RSS over the process's lifetime; ru_maxrss is in KiB on Linux but in bytes on macOS."""
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(max_rss) if sys.platform == "darwin" else max_rss * 1024.0


class MemoryMonitor:
    """Reads peak and current memory of this rank's device; `reset_peak_stats` starts a new log window."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.device_name = torch.cuda.get_device_name(device)
            self.capacity_bytes = torch.cuda.get_device_properties(device).total_memory
            self.reset_peak_stats()

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.is_cuda:
            return f"{self.device_name} with {self.capacity_bytes / _GIB:.2f} GiB memory"
        return "CPU: memory reported as process RSS (peak over the process lifetime, not per log window)"

    def get_peak_stats(self) -> dict[str, float]:
        """Memory metrics keyed by metric name: `memory/max_reserved_gib`, ... on CUDA; `memory/peak_rss_gib`,
        `memory/current_rss_gib` on CPU."""
        if self.is_cuda:
            stats = torch.cuda.memory_stats(self.device)
            max_allocated = stats.get("allocated_bytes.all.peak", 0)
            max_reserved = stats.get("reserved_bytes.all.peak", 0)
            return {
                "memory/max_allocated_gib": max_allocated / _GIB,
                "memory/max_allocated_pct": 100.0 * max_allocated / self.capacity_bytes,
                "memory/max_reserved_gib": max_reserved / _GIB,
                "memory/max_reserved_pct": 100.0 * max_reserved / self.capacity_bytes,
                "memory/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "memory/num_ooms": float(stats.get("num_ooms", 0)),
            }
        metrics = {"memory/peak_rss_gib": _peak_rss_bytes() / _GIB}
        current = _current_rss_bytes()
        if current is not None:
            metrics["memory/current_rss_gib"] = current / _GIB
        return metrics

    def reset_peak_stats(self) -> None:
        """Start a new window for the CUDA peaks (the CPU's peak RSS cannot be reset: it is lifetime-only)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)


def local_state_bytes(model_parts, optimizers) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank actually holds (local shards of
    DTensors), the measure of what FSDP saves. Gradients count where they exist (between backward and
    zero_grad)."""
    from torch.distributed.tensor import DTensor

    def nbytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = [p for m in model_parts for p in m.parameters()]
    out = {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(
            nbytes(v) for opt in optimizers.optimizers for st in opt.state.values() for v in st.values()
            if isinstance(v, torch.Tensor)
        ),
    }
    out["total"] = sum(out.values())
    return out
