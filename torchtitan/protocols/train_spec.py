"""TrainSpec: everything the trainer needs to know about a model, by name, and the registry of them.

The trainer only ever talks to a `TrainSpec`; a model folder builds one and registers it (one line in
torchtitan/models/__init__.py imports the folder). Every hook has a default, so a spec names only what its
model does differently: its own optimizer (e.g. per-group learning rates), LR schedule, validation, work after
each optimizer step (e.g. an MoE router's bias update), or a config section of its own.
"""

import dataclasses
import difflib
import importlib
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from torchtitan.components.optim.lr_scheduler import build_lr_schedulers
from torchtitan.components.optim.optimizer import build_optimizers
from torchtitan.components.validate import build_validator
from torchtitan.config import ConfigManager
from torchtitan.protocols.state_dict_adapter import StateDictAdapter


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    """Built as model_cls(args) on meta; must satisfy protocols.model.ModelProtocol."""
    flavors: dict[str, Any]
    """Flavor name -> model args (a protocols.model.BaseModelArgs dataclass)."""
    parallelize_fn: Callable
    """parallelize_fn(model, parallel_dims, job_config) -> model: the model's whole composition of TP, CP,
    AC, compile and FSDP, applied in place (also to each pipeline stage)."""
    build_tokenizer_fn: Callable
    """build_tokenizer_fn(job_config) -> Tokenizer."""
    build_dataloader_fn: Callable
    """build_dataloader_fn(tokenizer=, job_config=, split=, dp_rank=, dp_degree=, global_batch_size=,
    local_batch_size=, infinite=) -> a stateful loader of (inputs, labels) microbatches; inputs is a token
    tensor or a dict (see protocols.model.split_inputs)."""
    build_loss_fn: Callable
    """build_loss_fn(job_config) -> loss(logits, labels) returning the SUM of token losses (fp32). The trainer
    divides it by the step's global token count."""
    pipelining_fn: Callable | None = None
    """pipelining_fn(model, parallel_dims, job_config, device, parallelize_fn, loss_fn) -> Pipeline
    (distributed.pipeline.pipeline_model for any model that follows the model protocol); None: no PP."""
    state_dict_adapter: type[StateDictAdapter] | None = None
    """Converts state dicts, configs and folders to and from the Hugging Face layout."""
    build_optimizers_fn: Callable = build_optimizers
    """build_optimizers_fn(model_parts, optimizer_config, parallel_dims) -> OptimizersContainer."""
    build_lr_schedulers_fn: Callable = build_lr_schedulers
    """build_lr_schedulers_fn(optimizers, lr_scheduler_config, total_steps) -> LRSchedulersContainer."""
    build_validator_fn: Callable = build_validator
    """build_validator_fn(job_config) -> validate(forward_loss_sum, batches, reduce_sum) -> metrics dict."""
    post_optimizer_step_fns: tuple[Callable, ...] = ()
    """Each fn(model_parts, parallel_dims) runs after every optimizer step (e.g. an MoE router bias update)."""
    config_section: tuple[str, type] | None = None
    """(section name, dataclass) of this model's own options: `--model.name NAME` brings the section into
    the recipe, the command line and --help, with the same parsing and unknown-key errors as the others."""


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"a train spec named {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def _registered() -> dict[str, TrainSpec]:
    # The built-in model folders register themselves when torchtitan.models is imported. They are
    # discovered by name, not imported statically: the framework layer never depends on a model folder.
    importlib.import_module("torchtitan.models")
    return _REGISTRY


def get_train_spec(name: str) -> TrainSpec:
    specs = _registered()
    if name not in specs:
        near = difflib.get_close_matches(name, specs, n=3) or sorted(specs)
        raise ValueError(f"unknown model {name!r} (--model.name); registered models: {', '.join(near)}")
    return specs[name]


def model_config_section(name: str) -> tuple[str, type] | None:
    """The config section model `name` brings, if any (None for an unknown name: the config check of
    --model.name itself happens where the spec is looked up)."""
    spec = _registered().get(name)
    return spec.config_section if spec is not None else None


def config_manager(prog: str = "torchtitan", *, skip_retired: bool = False) -> ConfigManager:
    """The job-config parser every entry point uses: the built-in sections plus the section of the job's
    model (TrainSpec.config_section), which joins once the model name is read. `skip_retired`: see ConfigManager."""
    return ConfigManager(prog=prog, model_section=model_config_section, skip_retired=skip_retired)


def get_flavor(spec: TrainSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        near = difflib.get_close_matches(flavor, spec.flavors, n=3) or sorted(spec.flavors)
        raise ValueError(
            f"unknown flavor {flavor!r} for model {spec.name!r} (--model.flavor); try: {', '.join(near)}"
        )
    return spec.flavors[flavor]
