"""Optimizers for the model parts a rank holds, checkpointed by parameter name.

Pipeline parallelism gives a rank several model parts (stages); each gets its own torch optimizer and the
container steps them together. Its state dict is keyed by parameter FQN (through torch.distributed.checkpoint's
flattened optimizer state dict), not by the optimizer's positional parameter ids, so a checkpoint written under
one parallel layout (FSDP/TP DTensors, a different pipeline split) loads under another.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.components.optim.muon import MuonWithAdamW, check_muon_config, default_is_muon_param
from torchtitan.config.job_config import Optimizer as OptimizerConfig
from torchtitan.tools.logging import logger

_OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "AdamW": torch.optim.AdamW,
    "Adam": torch.optim.Adam,
}

# Flattened keys look like "state.layers.0.attention.wq.weight.exp_avg": one namespace for all model parts.
_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class OptimizersContainer:
    """One optimizer per model part, driven as one.

    `optimizers` is public so the LR scheduler builder can wrap each optimizer; it also satisfies DCP's Stateful
    protocol (state_dict / load_state_dict) so it can be placed directly in a checkpoint's state.
    """

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        if len(model_parts) != len(optimizers):
            raise ValueError(f"{len(model_parts)} model parts but {len(optimizers)} optimizers")
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.state_offload: list | None = None
        """--memory.offload_optimizer: one OffloadedOptimizerState per optimizer (components/optimizer_offload)."""

    def step(self) -> None:
        for i, optimizer in enumerate(self.optimizers):
            if self.state_offload is not None:  # streams the state from files, one block's parameters at a time
                self.state_offload[i].step(optimizer)
            else:
                optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The param groups of all optimizers, in model-part order (for reading or setting the LR)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """Optimizer state and hyperparameters of every part, merged, keyed by parameter FQN.

        Note: on an optimizer that has not stepped yet, DCP first initialises its state with a zero-LR step, so
        the state (e.g. Adam's step counter) differs from that of a never-touched optimizer.
        """
        merged: dict[str, Any] = {}
        for model, optimizer in zip(self.model_parts, self.optimizers):
            merged.update(get_optimizer_state_dict(model, optimizer, options=_STATE_DICT_OPTIONS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a merged state dict; each part picks the keys of its own parameters by FQN."""
        # The LR is the LR schedule's to set (it may be re-fit to a new training.steps, or not restored at
        # all); the one saved here belongs to the saved schedule, so each group keeps its current LR.
        lrs = [group["lr"] for group in self.param_groups]
        for model, optimizer in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, optimizer, optim_state_dict=state_dict, options=_STATE_DICT_OPTIONS)
        for group, lr in zip(self.param_groups, lrs):
            group["lr"] = lr


def _implementation_flags(implementation: str) -> dict[str, bool]:
    if implementation == "for-loop":
        return {"foreach": False, "fused": False}
    if implementation == "foreach":
        return {"foreach": True, "fused": False}
    if implementation == "fused":
        return {"foreach": False, "fused": True}
    raise ValueError(f"Unknown optimizer implementation {implementation!r}; use auto, for-loop, foreach or fused")


def _fused_error(optimizer_class: type[torch.optim.Optimizer], params: list[torch.Tensor]) -> str | None:
    """Why torch has no fused kernel for these parameters (None: it has one for every device and dtype).

    torch itself only notices at the first step, deep inside the training loop. A one-element probe step per
    (device, dtype) asks torch directly instead of mirroring its private list of supported devices.
    """
    for device, dtype in {(p.device, p.dtype) for p in params}:
        probe = torch.zeros(1, device=device, dtype=dtype, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            optimizer_class([probe], fused=True).step()
        except RuntimeError as e:
            return f"torch {torch.__version__} has no fused kernel for {dtype} parameters on {device.type} ({e})"
    return None


def resolve_implementation(
    implementation: str, optimizer_class: type[torch.optim.Optimizer], params: list[torch.Tensor]
) -> str:
    """The kernel a model part's AdamW/Adam runs: `auto` = fused (one kernel per step for all parameters;
    torch has it on CPU and CUDA for floating dtypes) where torch has it for every parameter's device and
    dtype, foreach otherwise. An explicit `fused` that torch lacks is refused here, at build time."""
    if implementation not in ("auto", "fused"):
        return implementation
    error = _fused_error(optimizer_class, params)
    if error is None:
        return "fused"
    if implementation == "fused":
        raise ValueError(f"optimizer.implementation='fused': {error}; use 'auto', 'foreach' or 'for-loop'.")
    return "foreach"


def _groups_by_kind(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """The parameters as param groups of one kind each: plain tensors, then DTensors. torch's foreach and fused
    kernels take one list per group and refuse a list mixing the two ("got mixed torch.Tensor and DTensor"),
    which a layout makes when some parameters stay plain beside sharded ones (DeepSeek-V3's MLA down-projections
    under TP with no FSDP). The groups share every hyperparameter; the flattened state dict keys by parameter
    name, so checkpoints load across layouts that group differently."""
    plain = [p for p in params if not isinstance(p, DTensor)]
    sharded = [p for p in params if isinstance(p, DTensor)]
    return [{"params": kind} for kind in (plain, sharded) if kind]


def _log_choice(cfg: OptimizerConfig, chosen: set[str]) -> None:
    how = "/".join(sorted(chosen)) or "none"
    why = " (auto: fused where torch has the kernel, foreach elsewhere)" if cfg.implementation == "auto" else ""
    logger.info(f"Optimizer: {cfg.name}, {how} kernel{why}")


def build_optimizers(
    model_parts: list[nn.Module],
    cfg: OptimizerConfig,
    parallel_dims=None,
    is_muon_param: Callable[[str, nn.Parameter], bool] = default_is_muon_param,
) -> OptimizersContainer:
    """One `cfg.name` optimizer per model part, over all of its trainable parameters. (The default
    `build_optimizers_fn` of a TrainSpec; `parallel_dims` is there for optimizers that need the layout.)

    Weight decay applies to every parameter, norms and embeddings included, as in torchtitan's reference
    recipes: exempting them changes the loss curves those recipes were tuned for.

    Muon: `is_muon_param(fqn, param)` picks the parameters that use Muon (default: 2-D weights of the
    blocks in `layers`); the rest use AdamW. A model with other needs passes its own rule through its spec:
    `build_optimizers_fn=functools.partial(build_optimizers, is_muon_param=rule)`.
    """
    if cfg.name == "Muon":
        return _build_muon(model_parts, cfg, is_muon_param)
    if cfg.name not in _OPTIMIZER_CLASSES:
        raise ValueError(f"Unknown optimizer {cfg.name!r}; choose one of {sorted([*_OPTIMIZER_CLASSES, 'Muon'])}")
    optimizer_class = _OPTIMIZER_CLASSES[cfg.name]
    make_optimizer = functools.partial(
        optimizer_class, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    optimizers, chosen = [], set()
    for model in model_parts:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"Model part {type(model).__name__} has no trainable parameters")
        implementation = resolve_implementation(cfg.implementation, optimizer_class, params)
        chosen.add(implementation)
        optimizers.append(make_optimizer(_groups_by_kind(params), **_implementation_flags(implementation)))
    _log_choice(cfg, chosen)
    return OptimizersContainer(model_parts, optimizers)


def _build_muon(
    model_parts: list[nn.Module], cfg: OptimizerConfig, is_muon_param: Callable[[str, nn.Parameter], bool]
) -> OptimizersContainer:
    """Per model part: one MuonWithAdamW with a Muon group (the parameters `is_muon_param` picks) and an
    AdamW group (the rest), both at cfg.lr and cfg.weight_decay."""
    check_muon_config(cfg)
    optimizers, chosen = [], set()
    for model in model_parts:
        muon, adamw = [], []
        for name, p in model.named_parameters():
            if p.requires_grad:
                (muon if is_muon_param(name, p) else adamw).append(p)
        if not muon and not adamw:
            raise ValueError(f"Model part {type(model).__name__} has no trainable parameters")
        groups = [{"params": muon, "use_muon": True}] if muon else []
        groups += [{**group, "use_muon": False} for group in _groups_by_kind(adamw)]
        # The AdamW group's kernel (Muon's own update has none to choose).
        implementation = resolve_implementation(cfg.implementation, torch.optim.AdamW, adamw) if adamw else "foreach"
        chosen.add(implementation)
        optimizers.append(MuonWithAdamW(
            groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
            momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov, ns_steps=cfg.muon_ns_steps,
            ns_dtype=cfg.muon_ns_dtype, update_rms=cfg.muon_update_rms, **_implementation_flags(implementation),
        ))
    _log_choice(cfg, chosen)
    return OptimizersContainer(model_parts, optimizers)
