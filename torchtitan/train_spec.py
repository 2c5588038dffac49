"""The train spec registry: what the trainer needs to know about a model, by name.

The trainer only ever talks to a `TrainSpec`; a model folder builds one and registers it. To add an
architecture, copy a model folder (e.g. torchtitan/models/llama3), change the model, register it under a new
name, and import the folder from torchtitan/models/__init__.py (or from your own code before training).

A model args object must provide `vocab_size` and `max_seq_len` fields (the trainer sets them from the
tokenizer and the recipe) and `flops_per_token(num_non_embedding_params, seq_len)`; the model class must be
constructible from its args on the meta device and provide `init_weights(buffer_device=None)`.
"""

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn


@dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    parallelize_fn: Callable
    """parallelize_fn(model, parallel_dims, job_config) -> model: applies TP, AC, compile, FSDP in place."""
    build_tokenizer_fn: Callable
    """build_tokenizer_fn(job_config) -> Tokenizer."""
    build_dataloader_fn: Callable
    """build_dataloader_fn(tokenizer=, job_config=, split=, dp_rank=, dp_degree=, global_batch_size=,
    local_batch_size=, infinite=) -> a stateful loader of (input, label) microbatches."""
    build_loss_fn: Callable
    """build_loss_fn(job_config) -> loss(logits, labels) returning the SUM of token losses (fp32)."""
    pipelining_fn: Callable | None = None
    """pipelining_fn(model, parallel_dims, job_config, device, model_args, loss_fn) -> (schedule, model_parts)."""
    state_dict_adapter: type | None = None
    """Converts state dicts to and from the Hugging Face layout (to_hf / from_hf)."""


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"a train spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    import torchtitan.models  # noqa: F401  (importing the model folders registers their specs)

    if name not in _REGISTRY:
        near = difflib.get_close_matches(name, _REGISTRY, n=3) or sorted(_REGISTRY)
        raise ValueError(f"unknown model {name!r} (--model.name); registered models: {', '.join(near)}")
    return _REGISTRY[name]


def get_flavor(spec: TrainSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        near = difflib.get_close_matches(flavor, spec.flavors, n=3) or sorted(spec.flavors)
        raise ValueError(
            f"unknown flavor {flavor!r} for model {spec.name!r} (--model.flavor); try: {', '.join(near)}"
        )
    return spec.flavors[flavor]
