"""Model converters: transformations applied to the model right after it is built on the meta device
(before parallelisation), selected by name with `--model.converters`, e.g. `--model.converters float8`.

A converter is built from the job config, the layout and the device (`build(job_config, parallel_dims, device)`,
which raises ValueError with one clear line when the combination cannot run) and provides:
  convert(model)                     swaps modules in place; must log what it changed
  post_optimizer_hook(model_parts)   runs after every optimizer step (e.g. precomputed float8 scales)
  post_parallelize(model_parts)      runs once the parts are parallelised, before the optimizer is built (e.g.
                                     LoRA re-freezes the base: TP styles re-create parameters as trainable)
  matmul_dtype                       the dtype its matmuls really run in, for the MFU peak (None = unchanged)

To add one, write a module that calls `register_model_converter(name, builder)` and import it below.
"""

import difflib
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn as nn

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims


class ModelConverter(Protocol):
    matmul_dtype: torch.dtype | None

    def convert(self, model: nn.Module) -> None: ...

    def post_optimizer_hook(self, model_parts: list[nn.Module]) -> None: ...

    def post_parallelize(self, model_parts: list[nn.Module]) -> None: ...


ConverterBuilder = Callable[[JobConfig, ParallelDims, torch.device], ModelConverter]
_REGISTRY: dict[str, ConverterBuilder] = {}


def register_model_converter(name: str, builder: ConverterBuilder) -> None:
    if name in _REGISTRY:
        raise ValueError(f"a model converter named {name!r} is already registered")
    _REGISTRY[name] = builder


class ModelConverters:
    """The converters of a job, applied in the order given on the command line."""

    def __init__(self, converters: list[ModelConverter]):
        self.converters = converters

    def convert(self, model: nn.Module) -> None:
        for c in self.converters:
            c.convert(model)

    def post_optimizer_hook(self, model_parts: list[nn.Module], parallel_dims: ParallelDims) -> None:
        """Runs each converter's hook; shaped like a TrainSpec's post_optimizer_step_fns."""
        for c in self.converters:
            c.post_optimizer_hook(model_parts)

    def post_parallelize(self, model_parts: list[nn.Module]) -> None:
        for c in self.converters:
            c.post_parallelize(model_parts)

    def matmul_dtype(self, default: torch.dtype) -> torch.dtype:
        """The dtype the model's matmuls run in after conversion (the last converter that sets one wins)."""
        for c in self.converters:
            default = c.matmul_dtype or default
        return default


def build_model_converters(job_config: JobConfig, parallel_dims: ParallelDims, device: torch.device) -> ModelConverters:
    built = []
    for name in job_config.model.converters:
        if name not in _REGISTRY:
            near = difflib.get_close_matches(name, _REGISTRY, n=3) or sorted(_REGISTRY)
            raise ValueError(f"unknown model converter {name!r} (--model.converters); available: {', '.join(near)}")
        built.append(_REGISTRY[name](job_config, parallel_dims, device))
    return ModelConverters(built)


# Importing a converter module registers it.
from torchtitan.components.quantization import float8  # noqa: E402,F401
from torchtitan.components.lora.adapters import LoRAConverter  # noqa: E402

register_model_converter("lora", LoRAConverter)  # not quantization, but a converter: registered here
