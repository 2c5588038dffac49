"""Float8 training of the linear layers, through torchao (`pip install torchao`).

Each selected nn.Linear becomes a torchao Float8Linear: in forward the input and the weight, and in backward the
output gradient, are cast to float8 (e4m3 for inputs/weights, e5m2 or e4m3 for gradients, per recipe) with
scales computed from their current absolute maxima, and the matmuls run on float8 tensor cores with high
precision accumulation. Weights, optimizer state and everything outside the converted linears keep the
training dtype.

Recipes (`--float8.recipe_name`):
  tensorwise  one scale per tensor (dynamic). Fastest; supports float8 FSDP all-gather.
  rowwise     one scale per row of each operand (more accurate with outliers); no float8 all-gather.

Which layers: every nn.Linear whose name contains none of `--float8.filter_fqns` and whose two dimensions are
multiples of 16 (a float8 GEMM requirement). The run logs how many layers were converted, and converting none
is an error: a float8 run that trains in bf16 would be a silent lie.

Hardware: tensorwise needs fp8 tensor cores (CUDA capability 8.9+: L4/L40/H100/H200/B200), rowwise 9.0+.
Elsewhere (CPU, older GPUs) `--float8.emulate` runs the same casts with the matmuls in float32: a correctness
path that reproduces float8's rounding, slower than plain training.
"""

import dataclasses
import logging

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.tools.logging import logger

# A float8 GEMM needs both dimensions of each operand divisible by 16.
_DIM_MULTIPLE = 16
_MIN_CAPABILITY = {"tensorwise": (8, 9), "rowwise": (9, 0)}


def _import_torchao():
    try:
        if not torch.cuda.is_available():
            # torchao tries to load its CUDA kernels at import and logs a warning per library that a CPU build
            # cannot load; float8 emulation does not use them.
            logging.getLogger("torchao").setLevel(logging.ERROR)
        import torchao.float8 as ao_float8
    except ImportError as e:
        raise ValueError(f"--model.converters float8 needs torchao ({e}); install it with `pip install torchao`") from e
    return ao_float8


def _check_hardware(recipe: str, emulate: bool, device: torch.device) -> None:
    if emulate:
        return
    need = _MIN_CAPABILITY[recipe]
    if device.type != "cuda":
        raise ValueError(
            f"float8 {recipe} needs a GPU with float8 tensor cores (CUDA capability {need[0]}.{need[1]}+); this run "
            f"is on {device.type}: add --float8.emulate to check numerics without them"
        )
    have = torch.cuda.get_device_capability(device)
    if have < need:
        raise ValueError(
            f"float8 {recipe} needs CUDA capability {need[0]}.{need[1]}+ but {torch.cuda.get_device_name(device)} "
            f"has {have[0]}.{have[1]}: add --float8.emulate (slow, for correctness) or use another recipe/GPU"
        )


def uses_float8_tensor_parallel(job_config: JobConfig, device_type: str) -> bool:
    """Whether TP should use the float8 parallel styles (casts to float8 before the collectives, so that TP
    all-gathers move float8 bytes). Only tensorwise scales survive a sharded cast: one amax all-reduce per
    tensor gives every rank the same scale, while rowwise would need the scales of rows on other ranks. gloo
    cannot move float8 tensors ("Invalid scalar type"), so on CPU the plain styles gather high-precision
    activations and the Float8Linear casts after the gather: the same numbers, more bytes."""
    return (
        "float8" in job_config.model.converters
        and job_config.float8.recipe_name == "tensorwise"
        and device_type == "cuda"
    )


class Float8Converter:
    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device):
        f8 = job_config.float8
        self.cfg = f8
        self.ao = _import_torchao()
        _check_hardware(f8.recipe_name, f8.emulate, device)
        if f8.recipe_name == "rowwise" and f8.enable_fsdp_float8_all_gather:
            raise ValueError(
                "--float8.enable_fsdp_float8_all_gather works with tensorwise scales only: use "
                "--float8.recipe_name tensorwise or drop the all-gather option"
            )
        if f8.precompute_float8_dynamic_scale_for_fsdp and not f8.enable_fsdp_float8_all_gather:
            raise ValueError(
                "--float8.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of float8 all-gathers: "
                "add --float8.enable_fsdp_float8_all_gather"
            )
        # Without FSDP sharding nothing is all-gathered: the options are inert, not wrong (a recipe may be run
        # on one device for debugging).
        self.fsdp_float8 = f8.enable_fsdp_float8_all_gather and parallel_dims.fsdp_enabled
        if f8.enable_fsdp_float8_all_gather and not self.fsdp_float8:
            logger.info("Float8: no FSDP sharding in this layout, so the float8 all-gather options do nothing")
        # torchao's emulation dequantises both operands and multiplies in float32.
        self.matmul_dtype = torch.float32 if f8.emulate else torch.float8_e4m3fn

    def _config(self):
        config = self.ao.Float8LinearConfig.from_recipe_name(self.cfg.recipe_name)
        return dataclasses.replace(
            config, emulate=self.cfg.emulate, enable_fsdp_float8_all_gather=self.fsdp_float8
        )

    def convert(self, model: nn.Module) -> None:
        converted, filtered, misshapen = [], [], []

        def select(module: nn.Linear, fqn: str) -> bool:  # torchao asks for each nn.Linear
            if any(pattern in fqn for pattern in self.cfg.filter_fqns):
                filtered.append(fqn)
            elif module.in_features % _DIM_MULTIPLE or module.out_features % _DIM_MULTIPLE:
                misshapen.append(fqn)
            else:
                converted.append(fqn)
                return True
            return False

        self.ao.convert_to_float8_training(model, config=self._config(), module_filter_fn=select)
        total = len(converted) + len(filtered) + len(misshapen)
        if not converted:
            raise ValueError(
                f"float8 converted none of the model's {total} linear layers (kept by --float8.filter_fqns "
                f"{self.cfg.filter_fqns}: {len(filtered)}; dimensions not multiples of {_DIM_MULTIPLE}: "
                f"{len(misshapen)}): narrow the filter or drop --model.converters float8"
            )
        kept = [f"{len(filtered)} by filter_fqns {self.cfg.filter_fqns}"] if filtered else []
        if misshapen:
            kept.append(f"{len(misshapen)} with dims not multiples of {_DIM_MULTIPLE} ({', '.join(misshapen[:3])}...)")
        logger.info(
            f"Float8 {self.cfg.recipe_name}{' (emulated)' if self.cfg.emulate else ''}: converted {len(converted)} "
            f"of {total} linear layers" + (f"; kept in high precision: {'; '.join(kept)}" if kept else "")
            + (" with float8 FSDP all-gather" if self.fsdp_float8 else "")
        )

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None:
        if self.cfg.precompute_float8_dynamic_scale_for_fsdp and self.fsdp_float8:
            # One all-reduce for the scales of all weights, instead of one per weight in the next forward.
            for m in model_parts:
                self.ao.precompute_float8_dynamic_scale_for_fsdp(m)

    def post_parallelize(self, model_parts: list[nn.Module]) -> None:
        pass


def _build(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device) -> Float8Converter:
    return Float8Converter(job_config, parallel_dims, device)


from torchtitan.components.quantization import register_model_converter  # noqa: E402

register_model_converter("float8", _build)
