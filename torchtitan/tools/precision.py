"""Floating-point precision: the one map from config names to torch dtypes, and the dtypes a job trains in.

`training.mixed_precision_param = "auto"` (the default) picks the fastest dtype the device multiplies natively:
bfloat16 on CPUs with AVX-512-BF16 or AMX (x86) or the BF16 extension (Arm), and on CUDA GPUs of compute
capability 8.0 or newer; float32 elsewhere. Elsewhere bfloat16 is emulated: on an AVX2-only CPU a bf16 linear runs
10-100x slower than fp32, so a bf16 default there turns a one-minute recipe into half an hour. An explicit 16-bit
dtype is honoured even where it is emulated, with one warning saying how much slower it is and how to fix it.
"""

import dataclasses
import os
import platform
import time

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

# x86 / Arm CPU features (names from torch.cpu.get_capabilities) that give native 16-bit matmuls.
_CPU_NATIVE_FEATURES = {
    torch.bfloat16: {"x86": ("amx_bf16", "avx512_bf16"), "arm": ("bf16", "sve_bf16")},
    torch.float16: {"x86": ("amx_fp16", "avx512_fp16"), "arm": ("fp16_arith",)},
}
# ONEDNN_MAX_CPU_ISA values that still allow oneDNN's native kernels of each 16-bit dtype; a lower cap makes
# oneDNN emulate them even on a CPU that has the instructions.
_ONEDNN_NATIVE_ISAS = {
    torch.bfloat16: {"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
                     "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "ALL", "DEFAULT"},
    torch.float16: {"AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "ALL",
                    "DEFAULT"},
}
_FEATURE_TEXT = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX-512-BF16", "amx_fp16": "AMX-FP16",
                 "avx512_fp16": "AVX-512-FP16", "bf16": "BF16", "sve_bf16": "SVE-BF16", "fp16_arith": "FP16"}


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _linear_seconds(dtype: torch.dtype, n: int = 256, reps: int = 3) -> float:
    """Best time of an n x n linear (the op the model's layers run) in `dtype` on CPU."""
    x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    F.linear(x, w)  # warm-up: kernel selection
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def _cpu_native(dtype: torch.dtype) -> tuple[bool, str]:
    caps = torch.cpu.get_capabilities()
    name, short = cpu_model_name(), DTYPE_NAMES[dtype]
    isa_cap = os.environ.get("ONEDNN_MAX_CPU_ISA")
    if isa_cap and isa_cap.upper() not in _ONEDNN_NATIVE_ISAS[dtype]:
        return False, f"ONEDNN_MAX_CPU_ISA={isa_cap} keeps the matmuls of {name} from native {short} kernels"
    kind = "x86" if "avx2" in caps else "arm" if "neon" in caps else None
    if kind is None:
        # No feature flags to go by: a tiny timed linear decides (native 16-bit is at least as fast as fp32).
        ratio = _linear_seconds(dtype) / _linear_seconds(torch.float32)
        return ratio <= 1.0, f"{name}: a {short} linear measured {ratio:.1f}x the time of a float32 one"
    features = _CPU_NATIVE_FEATURES[dtype][kind]
    have = [_FEATURE_TEXT[f] for f in features if caps.get(f)]
    if have:
        return True, f"{name} has native {short} matmuls ({', '.join(have)})"
    wanted = " or ".join(_FEATURE_TEXT[f] for f in features)
    return False, f"{name} has no native {short} matmuls (no {wanted}): it emulates them"


def native_matmul(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether `device` multiplies `dtype` matrices natively (float32 always does), and why, in a few words."""
    if dtype == torch.float32:
        return True, "float32"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        need = (8, 0) if dtype == torch.bfloat16 else (7, 0)  # bf16 tensor cores: Ampere; fp16: Volta
        has = "has" if (major, minor) >= need else "has no"
        return (major, minor) >= need, (
            f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) {has} "
            f"{DTYPE_NAMES[dtype]} tensor cores (from {need[0]}.{need[1]})"
        )
    if device.type == "cpu":
        return _cpu_native(dtype)
    return True, f"{device.type} devices run {DTYPE_NAMES[dtype]} natively"


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes a job trains in on its device."""

    param: torch.dtype
    """Parameters are stored and updated in this dtype (training.dtype)."""
    mixed: torch.dtype
    """Forward/backward compute dtype of fp32 parameters: FSDP's mixed-precision policy, autocast without FSDP
    (training.mixed_precision_param with "auto" resolved)."""
    reason: str
    """One line: what was picked and why."""
    emulated: str | None = None
    """When an explicitly chosen 16-bit dtype is emulated on the device: why, in a few words."""

    @property
    def matmul(self) -> torch.dtype:
        """The dtype the model's linear layers really multiply in."""
        return self.param if self.param != torch.float32 else self.mixed


def resolve_precision(dtype: str, mixed_precision_param: str, device: torch.device) -> Precision:
    """The dtypes of a job on `device`, from training.dtype and training.mixed_precision_param ("auto" or a
    dtype name)."""
    param = DTYPES[dtype]
    if mixed_precision_param == "auto":
        native, why = native_matmul(device, torch.bfloat16)
        mixed = torch.bfloat16 if native else torch.float32
        reason = f"mixed_precision_param auto -> {DTYPE_NAMES[mixed]}: {why}"
    else:
        mixed = DTYPES[mixed_precision_param]
        reason = f"mixed_precision_param {mixed_precision_param} (set explicitly)"
    if param != torch.float32:
        reason += f"; parameters in {dtype} (training.dtype), so the matmuls run in {dtype}"
    precision = Precision(param=param, mixed=mixed, reason=reason)
    if precision.matmul == torch.float32:
        return precision
    native, why = native_matmul(device, precision.matmul)
    if native:
        return precision
    return dataclasses.replace(precision, reason=f"{reason}; emulated: {why}", emulated=why)


def emulation_warning(precision: Precision, device: torch.device) -> str:
    """One line for a run whose explicitly chosen 16-bit dtype the device emulates: how much slower, how to fix."""
    name = DTYPE_NAMES[precision.matmul]
    slowdown = ""
    if device.type == "cpu":
        ratio = _linear_seconds(precision.matmul) / _linear_seconds(torch.float32)
        slowdown = f"; a {name} linear measured {ratio:.0f}x slower than float32 here"
    if precision.param != torch.float32:
        fix = "--training.dtype float32 --training.mixed_precision_param auto"
    else:
        fix = "--training.mixed_precision_param auto (or float32)"
    return f"training in {name}, which this device emulates ({precision.emulated}){slowdown}; for full speed use {fix}"


def fsdp_dtypes(training, device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of FSDP's mixed-precision policy for a job's `training` section, with
    mixed_precision_param "auto" resolved for `device_type`: what every model's parallelize passes to apply_fsdp."""
    mixed = resolve_precision(training.dtype, training.mixed_precision_param, torch.device(device_type)).mixed
    return mixed, DTYPES[training.mixed_precision_reduce]
