"""Peak FLOP/s of a device, the denominator of MFU.

GPUs: vendor datasheet peaks for dense matrix math (no 2:4 sparsity), by device name, with the 16-bit and fp8
peaks kept apart. CPUs and GPUs not in the table: measured as the best of a few large square linears (the op
the model's layers run) in the dtype the model multiplies in, cached on disk. MFU is never clamped: a value
above 100% means this peak is wrong, and the metrics logger says so.
"""

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from torchtitan.tools.logging import logger
from torchtitan.tools.precision import cpu_model_name

_TFLOPS = 1e12

# (substring of torch.cuda.get_device_name, {"bf16": ..., "fp8": ..., "tf32": ...}) in TFLOP/s, dense.
# More specific names come first: "H100 NVL" must win over "H100". "bf16" also serves float16. A missing
# "fp8" means the chip has no fp8 tensor cores (float8 is emulated in 16-bit there); a missing "tf32" means
# float32 is measured instead.
_GPU_PEAKS_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("GB200", {"bf16": 2500.0, "fp8": 5000.0, "tf32": 1250.0}),
    ("B200", {"bf16": 2250.0, "fp8": 4500.0, "tf32": 1100.0}),
    ("H200", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H100 NVL", {"bf16": 835.5, "fp8": 1670.5, "tf32": 417.5}),
    ("H100 PCIe", {"bf16": 756.5, "fp8": 1513.0, "tf32": 378.0}),
    ("H100", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),  # SXM, and the default for other H100 names
    ("H800", {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7}),
    ("H20", {"bf16": 148.0, "fp8": 296.0, "tf32": 74.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0}),
    ("A800", {"bf16": 312.0, "tf32": 156.0}),
    ("L40S", {"bf16": 362.05, "fp8": 733.0, "tf32": 183.0}),
    ("L40", {"bf16": 181.05, "fp8": 362.0, "tf32": 90.5}),
    ("L4", {"bf16": 121.0, "fp8": 242.5, "tf32": 60.0}),
    ("A10G", {"bf16": 70.0, "tf32": 35.0}),  # the AWS variant: about half the A10's tensor throughput
    ("A10", {"bf16": 125.0, "tf32": 62.5}),
    ("MI300X", {"bf16": 1307.4, "fp8": 2614.9, "tf32": 653.7}),
    ("MI325X", {"bf16": 1307.4, "fp8": 2614.9, "tf32": 653.7}),
    ("MI300A", {"bf16": 980.6, "fp8": 1961.2, "tf32": 490.3}),
    ("MI250X", {"bf16": 383.0}),
    ("MI250", {"bf16": 362.1}),
]

# Square GEMM sizes tried in order; each larger one only if the time budget still allows it.
_CPU_GEMM_SIZES = (256, 512, 1024, 2048)
_GPU_GEMM_SIZES = (2048, 4096, 8192)
_MEASURE_BUDGET_S = 1.5
_REPS = 3


def _is_float8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _peak_column(dtype: torch.dtype) -> str:
    if _is_float8(dtype):
        return "fp8"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if dtype == torch.float32:
        return "tf32"
    raise ValueError(f"No peak FLOP/s defined for dtype {dtype}")


def gpu_peak_from_name(name: str, dtype: torch.dtype) -> float | None:
    """Datasheet dense peak FLOP/s of the GPU called `name` at `dtype`, or None when the table cannot tell.

    float8 on a GPU without fp8 tensor cores answers the 16-bit peak: float8 training is emulated in 16-bit
    there, so that is the math the chip actually runs.
    """
    column = _peak_column(dtype)
    for key, peaks in _GPU_PEAKS_TFLOPS:
        if key.lower() in name.lower():
            if column == "fp8" and "fp8" not in peaks:
                column = "bf16"
            return peaks[column] * _TFLOPS if column in peaks else None
    return None


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def measure_gemm_flops(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> float:
    """Best FLOP/s over square linears of `sizes` (x @ w.T, the op and weight layout of the model's linear
    layers), warmed up, best of a few repetitions.

    The op matters: where a 16-bit dtype is emulated (bf16 on an AVX2 CPU) `torch.mm` and `F.linear` take
    different kernels, 10x apart, so a peak measured with `torch.mm` sat below what the linears achieved and
    MFU read 257%.

    Sizes are tried smallest first and a larger one only if its predicted time (8x the previous size's) fits the
    budget: some CPUs run a 16-bit dtype in slow emulation, where a single 2048 GEMM takes a minute.
    """
    deadline = time.perf_counter() + _MEASURE_BUDGET_S
    best = 0.0
    last_rep_s = 0.0
    for n in sizes:
        if last_rep_s and time.perf_counter() + last_rep_s * 8 * (_REPS + 1) > deadline:
            break
        x = torch.randn(n, n, device=device).to(dtype)
        w = torch.randn(n, n, device=device).to(dtype)
        F.linear(x, w)  # warm-up: kernel selection, page faults, thread pool start
        _synchronize(device)
        rep_times = []
        for _ in range(_REPS):
            start = time.perf_counter()
            F.linear(x, w)
            _synchronize(device)
            rep_times.append(time.perf_counter() - start)
        last_rep_s = min(rep_times)
        best = max(best, 2 * n**3 / last_rep_s)
    return best


def _cache_dir() -> Path:
    return Path(os.environ.get("TORCHTITAN_CACHE_DIR", Path.home() / ".cache" / "torchtitan"))


def _cached_measurement(key: str, measure: Callable[[], float], *, remeasure: bool = False) -> float:
    """Measured FLOP/s for `key`: the best ever recorded in the JSON cache.

    With `remeasure`, a new measurement runs even when the cache has one and the cache keeps the larger: a
    shared machine under load measures low, and a low peak would inflate MFU past 100%, so the cached value
    only ever moves towards the machine's true peak.
    """
    cache_file = _cache_dir() / "device_peak_flops.json"
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache and not remeasure:
        return float(cache[key])
    flops = max(measure(), float(cache.get(key, 0.0)))
    if flops == cache.get(key):
        return flops
    cache[key] = flops
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        # Several ranks of one machine may measure at once: write a private file and rename it atomically.
        tmp = cache_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(cache_file)
    except OSError as e:
        logger.warning(f"Could not cache the measured peak FLOP/s in {cache_file}: {e}")
    return flops


def peak_flops(device: torch.device, dtype: torch.dtype, *, num_threads: int | None = None,
               remeasure: bool = True) -> float:
    """Peak FLOP/s of `device` at compute `dtype` (a float8 dtype asks for the fp8 peak).

    `num_threads` (CPU only) defaults to torch.get_num_threads(); the measurement runs with it and is cached per
    CPU model, dtype and thread count. A CPU measures again each call (the cache keeps the best) unless
    `remeasure` is False, which takes the cached value when there is one (an estimate that needs no precision).
    """
    if device.type != "cpu":
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        peak = gpu_peak_from_name(name, dtype)
        if peak is not None:
            return peak
        # float8 matmuls need scaled-mm kernels; the 16-bit GEMM is the closest measurable stand-in.
        measure_dtype = torch.bfloat16 if _is_float8(dtype) else dtype
        logger.warning(f"No datasheet peak for {name} at {dtype}; measuring {measure_dtype} GEMMs instead")
        key = f"{name}|{measure_dtype}"
        return _cached_measurement(key, lambda: measure_gemm_flops(device, measure_dtype, _GPU_GEMM_SIZES))

    threads = num_threads or torch.get_num_threads()
    # CPUs have no float8 matmul; the trainer asks for the dtype emulated float8 really multiplies in, so a
    # float8 request here only stands for "the fastest 16-bit GEMM".
    measure_dtype = torch.bfloat16 if _is_float8(dtype) else dtype
    # The op is part of the key (peaks cached by older versions timed torch.mm), and so is a oneDNN ISA cap,
    # which changes the kernels the same CPU runs.
    key = f"{cpu_model_name()}|{measure_dtype}|threads={threads}|op=linear"
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        key += f"|isa={os.environ['ONEDNN_MAX_CPU_ISA'].upper()}"

    def measure() -> float:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return measure_gemm_flops(device, measure_dtype, _CPU_GEMM_SIZES)
        finally:
            torch.set_num_threads(previous)

    return _cached_measurement(key, measure, remeasure=remeasure)
