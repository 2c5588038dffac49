"""`compile.auto`: compile the transformer blocks when the run is long enough to repay the compile.

Regional compile (distributed/compile.py) fuses RMSNorm, RoPE and SwiGLU's elementwise ops into the blocks'
kernels: measured 1.045x tokens/s over the eager defaults at a 1B-shaped Llama slice (idle, 2026-12-03; 1.14x
earlier with glibc keeping freed memory) and 1.09-1.15x at the debugmodel on CPU
(docs/performance.md), i.e. it saves about GAIN of an eager step. It costs one compile at the first step: about
COLD_COMPILE_S with an empty inductor cache, WARM_COMPILE_S when this job's shapes were compiled before on this
machine (the FX graph cache then loads the kernels). A run of a few steps does not repay it, so it stays eager.

The rule, decided in plan_job before any rank starts (so every rank and the pre-flight check agree):

    compile when  steps x GAIN x estimated eager step time  >  compile time (cold or warm)

The eager step time is estimated from the model's FLOPs per step on one rank and the device's peak
(tools/device_peak: the datasheet on GPUs, the measured best GEMM on CPUs, cached on disk) at EAGER_MFU, a
deliberately high share: a step estimated too short errs towards staying eager. It stays off on CPU runs of
several processes: those ranks
share the machine's cores, so each compiles while the others wait for cores, and the peak they would each
measure differs (the ranks must agree). The log names the choice and its figures.
"""

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from torchtitan.config.job_config import JobConfig

GAIN = 0.045
"""Share of an eager step regional compile saves: 1 - 1/1.045 ~ 0.043, the lowest gain measured (the 1B slice
with the shipped defaults, CPU, bf16; docs/performance.md), so the rule errs towards eager."""

COLD_COMPILE_S = {"cpu": 45.0, "cuda": 60.0}
"""One compile of the blocks with an empty cache: 33-39 s measured for the debugmodel on CPU (a larger block
compiles the same graph); on GPUs an estimate (not measured by this project), other devices as cuda."""

WARM_COMPILE_S = {"cpu": 8.0, "cuda": 15.0}
"""The same compile when the FX graph cache holds its kernels: ~7 s measured (debugmodel_tiny, CPU)."""

EAGER_MFU = {"cpu": 0.6, "cuda": 0.5}
"""The share of the peak an eager step is assumed to reach (high: errs towards a shorter step, so eager)."""


@dataclasses.dataclass(frozen=True)
class CompileChoice:
    enable: bool
    reason: str
    """One line for the log: what was chosen and the figures behind it."""
    key: str = ""
    """The job's compile key (job_key): the trainer remembers it once a compiled first step has run."""


def job_key(cfg: JobConfig, model_args: object, parallel_degrees: tuple, device_type: str) -> str:
    """What decides the compiled graphs of a job: its block shapes, batch, precision, layout and torch."""
    t = cfg.training
    text = repr((repr(model_args), t.seq_len, t.local_batch_size, t.mixed_precision_param, t.dtype,
                 cfg.activation_checkpoint.mode, parallel_degrees, device_type, torch.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _marker(key: str) -> Path:
    from torchtitan.distributed.compile import configure_compile_cache

    return Path(configure_compile_cache()) / "torchtitan_compiled" / key


def compiled_before(key: str) -> bool:
    """Whether a run of this job's shapes compiled its blocks on this machine (the cache then holds them)."""
    return _marker(key).exists()


def remember_compiled(key: str) -> None:
    """Called after a compiled run's first step: the next run of these shapes finds its kernels cached."""
    path = _marker(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:  # a read-only cache only makes the next estimate cold
        pass


def choose(cfg: JobConfig, *, step_flops: float, peak_flops: float | None, device_type: str, world_size: int,
           cached: bool) -> CompileChoice:
    """The auto rule (module docstring). `step_flops`: model FLOPs of one optimizer step on one rank;
    `peak_flops`: the device's peak in the matmul dtype (None where unknown); `cached`: compiled_before."""
    if cfg.compile.enable:
        return CompileChoice(True, "Compile: on (--compile.enable)")
    off = "Compile: off (--compile.auto"
    if not cfg.compile.auto:
        return CompileChoice(False, f"{off} false); regional compile saves ~{GAIN:.1%} of a step after a "
                                    f"{COLD_COMPILE_S.get(device_type, COLD_COMPILE_S['cuda']):.0f} s compile")
    if "model" not in cfg.compile.components:
        return CompileChoice(False, f"{off}: 'model' is not in --compile.components)")
    if device_type == "cpu" and world_size > 1:
        return CompileChoice(False, f"{off}: {world_size} CPU processes share this machine's cores; "
                                    f"--compile.enable compiles in each)")
    if not peak_flops:
        return CompileChoice(False, f"{off}: no peak FLOP/s known for {device_type} to estimate the step)")
    step_s = step_flops / (peak_flops * EAGER_MFU.get(device_type, EAGER_MFU["cuda"]))
    table = WARM_COMPILE_S if cached else COLD_COMPILE_S
    compile_s = table.get(device_type, table["cuda"])
    saved = cfg.training.steps * GAIN * step_s
    figures = (f"{cfg.training.steps} steps x {GAIN:.3g} x ~{step_s:.3g} s a step (estimated: "
               f"{step_flops / 1e12:.3g} TFLOP at {EAGER_MFU.get(device_type, EAGER_MFU['cuda']):.0%} of "
               f"{peak_flops / 1e12:.3g} TFLOP/s) = {saved:.0f} s saved vs ~{compile_s:.0f} s to compile "
               f"({'warm' if cached else 'cold'} cache)")
    if saved > compile_s:
        return CompileChoice(True, f"Compile: on (--compile.auto: the run repays it: {figures}; "
                                   f"--compile.auto false keeps it eager)")
    return CompileChoice(False, f"{off}: too short to repay it: {figures}; --compile.enable compiles anyway)")


def resolve_compile_auto(cfg: JobConfig, model: torch.nn.Module, model_args: object, parallel_dims, device_type: str,
            world_size: int, matmul_dtype: torch.dtype) -> CompileChoice:
    """Applies the auto rule to `cfg` (compile.enable, and components reduced to the blocks, what was
    measured) and returns the choice. `model` on meta, as plan_job builds it."""
    from torchtitan.tools.params import count_params

    t = cfg.training
    _, non_embedding = count_params(model)
    pd = parallel_dims
    # Each rank's share of the step's FLOPs: its microbatches' tokens, its shard of the model's work.
    global_bs = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * pd.dp
    tokens = global_bs * t.seq_len / max(pd.dp, 1) / max(pd.cp, 1)
    step_flops = model_args.flops_per_token(non_embedding, t.seq_len) * tokens / max(pd.tp * pd.pp, 1)
    peak = None
    if not (cfg.compile.enable or not cfg.compile.auto or (device_type == "cpu" and world_size > 1)):
        from torchtitan.tools.device_peak import peak_flops

        peak = peak_flops(torch.device(device_type), matmul_dtype, remeasure=False)
    degrees = (pd.dp_replicate, pd.dp_shard, pd.cp, pd.tp, pd.pp, pd.ep)
    key = job_key(cfg, model_args, degrees, device_type)
    choice = choose(cfg, step_flops=step_flops, peak_flops=peak, device_type=device_type, world_size=world_size,
                    cached=compiled_before(key))
    choice = dataclasses.replace(choice, key=key)
    if choice.enable and not cfg.compile.enable:
        cfg.compile.enable = True
        cfg.compile.components = ["model"]
    return choice
