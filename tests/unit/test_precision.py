"""The dtype a job trains in is chosen by its device: bf16 only where the device multiplies bf16 natively.

Each device kind is mocked through what torch reports (CPU feature flags, CUDA compute capability), so the
choice is tested for every kind on any machine."""

import pytest
import torch

from torchtitan.tools import precision as prec
from torchtitan.tools.precision import emulation_warning, resolve_precision

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)

ZEN2 = {"architecture": "x86_64", "avx2": True, "fma3": True, "avx512_f": False, "avx512_bf16": False,
        "amx_bf16": False}
CASCADE_LAKE = {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": False}
COOPER_LAKE = {"architecture": "x86_64", "avx2": True, "avx512_f": True, "avx512_bf16": True}
SAPPHIRE_RAPIDS = {"architecture": "x86_64", "avx2": True, "avx512_bf16": True, "amx_bf16": True, "amx_tile": True}
GRAVITON2 = {"architecture": "aarch64", "neon": True, "bf16": False, "fp16_arith": True}
GRAVITON3 = {"architecture": "aarch64", "neon": True, "bf16": True, "sve": True, "sve_bf16": True}


@pytest.fixture
def cpu_with(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(prec, "cpu_model_name", lambda: "Test CPU")

    def set_caps(caps):
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: caps)

    return set_caps


@pytest.mark.parametrize(
    "caps, picked, why",
    [
        (ZEN2, torch.float32, "no native bfloat16 matmuls (no AMX-BF16 or AVX-512-BF16)"),
        (CASCADE_LAKE, torch.float32, "no native bfloat16 matmuls"),
        (COOPER_LAKE, torch.bfloat16, "has native bfloat16 matmuls (AVX-512-BF16)"),
        (SAPPHIRE_RAPIDS, torch.bfloat16, "has native bfloat16 matmuls (AMX-BF16, AVX-512-BF16)"),
        (GRAVITON2, torch.float32, "no native bfloat16 matmuls (no BF16 or SVE-BF16)"),
        (GRAVITON3, torch.bfloat16, "has native bfloat16 matmuls (BF16, SVE-BF16)"),
    ],
)
def test_auto_on_cpu_follows_the_bf16_matmul_features(cpu_with, caps, picked, why):
    cpu_with(caps)
    p = resolve_precision("float32", "auto", CPU)
    assert (p.param, p.mixed, p.matmul) == (torch.float32, picked, picked)
    assert p.reason.startswith(f"mixed_precision_param auto -> {prec.DTYPE_NAMES[picked]}: Test CPU")
    assert why in p.reason and p.emulated is None


def test_a_onednn_isa_cap_below_bf16_means_emulated(cpu_with, monkeypatch):
    cpu_with(SAPPHIRE_RAPIDS)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx2")
    p = resolve_precision("float32", "auto", CPU)
    assert p.mixed == torch.float32 and "ONEDNN_MAX_CPU_ISA=avx2" in p.reason
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert resolve_precision("float32", "auto", CPU).mixed == torch.bfloat16


@pytest.mark.parametrize("bf16_over_fp32_time, picked", [(0.5, torch.bfloat16), (40.0, torch.float32)])
def test_a_cpu_without_feature_flags_is_decided_by_a_timed_linear(cpu_with, monkeypatch, bf16_over_fp32_time,
                                                                  picked):
    cpu_with({"architecture": "riscv64"})
    monkeypatch.setattr(prec, "_linear_seconds", lambda dtype: bf16_over_fp32_time if dtype == torch.bfloat16 else 1.0)
    p = resolve_precision("float32", "auto", CPU)
    assert p.mixed == picked and f"measured {bf16_over_fp32_time:.1f}x the time of a float32 one" in p.reason


@pytest.mark.parametrize(
    "name, capability, picked",
    [
        ("Tesla V100-SXM2-32GB", (7, 0), torch.float32),
        ("Tesla T4", (7, 5), torch.float32),
        ("NVIDIA A100-SXM4-80GB", (8, 0), torch.bfloat16),
        ("NVIDIA GeForce RTX 3090", (8, 6), torch.bfloat16),
        ("NVIDIA H100 80GB HBM3", (9, 0), torch.bfloat16),
    ],
)
def test_auto_on_cuda_needs_compute_capability_8(monkeypatch, name, capability, picked):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    p = resolve_precision("float32", "auto", CUDA)
    assert p.mixed == picked and p.emulated is None
    assert f"{name} (compute capability {capability[0]}.{capability[1]})" in p.reason


def test_explicit_bf16_on_an_emulating_cpu_runs_with_one_warning_naming_the_slowdown_and_fix(cpu_with, monkeypatch):
    cpu_with(ZEN2)
    monkeypatch.setattr(prec, "_linear_seconds", lambda dtype: 96.0 if dtype == torch.bfloat16 else 1.0)
    p = resolve_precision("float32", "bfloat16", CPU)
    assert p.mixed == torch.bfloat16  # honoured, not overridden
    assert p.emulated == "Test CPU has no native bfloat16 matmuls (no AMX-BF16 or AVX-512-BF16): it emulates them"
    warning = emulation_warning(p, CPU)
    assert "\n" not in warning
    assert "measured 96x slower than float32" in warning
    assert warning.endswith("for full speed use --training.mixed_precision_param auto (or float32)")

    # bf16 parameters make the matmuls bf16 whatever the mixed precision setting: the fix names training.dtype.
    p = resolve_precision("bfloat16", "auto", CPU)
    assert p.param == p.matmul == torch.bfloat16 and p.mixed == torch.float32 and p.emulated
    assert "--training.dtype float32" in emulation_warning(p, CPU)


def test_explicit_choices_on_native_devices_are_quiet(cpu_with, monkeypatch):
    cpu_with(SAPPHIRE_RAPIDS)
    assert resolve_precision("float32", "bfloat16", CPU).emulated is None
    assert resolve_precision("float32", "float32", CPU) == prec.Precision(
        torch.float32, torch.float32, "mixed_precision_param float32 (set explicitly)"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    assert resolve_precision("float32", "float16", CUDA).emulated is None  # fp16 tensor cores from 7.0
    assert "has no bfloat16 tensor cores" in resolve_precision("float32", "bfloat16", CUDA).emulated


def test_this_machine_picks_what_its_flags_say(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    caps = torch.cpu.get_capabilities()
    native = any(caps.get(f) for f in ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"))
    p = resolve_precision("float32", "auto", CPU)
    if "avx2" in caps or "neon" in caps:
        assert p.mixed == (torch.bfloat16 if native else torch.float32), p.reason


def test_fsdp_policy_resolves_auto_for_every_model(cpu_with):
    """Every model's parallelize takes FSDP's dtypes from fsdp_dtypes; "auto" (the default) must resolve there,
    not be looked up as a dtype name (Qwen3 and the MoE models crashed with KeyError 'auto' under FSDP)."""
    from torchtitan.config import JobConfig

    t = JobConfig().training
    assert t.mixed_precision_param == "auto"
    cpu_with({"avx2": True, "avx512_bf16": True})  # flags of an x86 CPU: without avx2 a timed linear decides
    assert prec.fsdp_dtypes(t, "cpu") == (torch.bfloat16, torch.float32)
    cpu_with({"avx2": True})
    assert prec.fsdp_dtypes(t, "cpu") == (torch.float32, torch.float32)
