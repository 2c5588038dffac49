"""Activation checkpointing (AC): trade recomputation in backward for activation memory.

Modes (`--activation_checkpoint.mode`):
  none       every block keeps what autograd saves.
  full       every transformer block keeps only its input; backward re-runs the block's forward first.
  selective  `selective_ac_option` = an integer k: full AC on every k-th block (blocks k-1, 2k-1, ... counting
             from 0), the others keep everything; k=1 is full AC.
             `selective_ac_option` = "op": every block keeps the outputs of its expensive ops (see
             `_SAVE_OPS`) and recomputes only the cheap ones (norms, RoPE, SiLU, products, residual adds).
  memory_budget  no wrapping: the compiler's partitioner chooses what to save so that saved activations stay
             under `memory_budget` (a fraction of what no-AC saves). Needs compile of the model.

AC never changes the numbers: recomputation runs the same ops on the same inputs, so gradients are bitwise
equal to a run without AC (tests/unit/test_activation_checkpoint.py checks this for every mode).

Per block (`--memory.block_choices`, or the plan `--memory.budget_gib` resolves to): keep | op | full | offload,
where offload moves the block's saved activations to a slower tier (distributed/activation_offload.py) instead
of recomputing them; `apply_block_choices` wraps each block by its choice.

Blocks are wrapped with torch.distributed's checkpoint_wrapper. Its state-dict hooks strip the wrapper's
`_checkpoint_wrapped_module.` prefix, so checkpoints and HF exports keep the plain parameter names; attribute
access (block.attention) falls through to the wrapped block.
"""

from collections import defaultdict

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from torchtitan.config.job_config import ActivationCheckpoint as ACConfig
from torchtitan.config.job_config import Memory as MemoryConfig
from torchtitan.distributed.activation_offload import ActivationOffloader, OffloadedBlock, make_tier
from torchtitan.tools.logging import logger

_aten = torch.ops.aten

# Ops whose outputs the "op" policy saves. Matmuls and attention are where the FLOPs are: recomputing them would
# cost a second forward's worth of compute, while everything else in a block is element-wise or a reduction
# and costs a few % of the block's time to redo. Every matmul is saved (torchtitan saves every other one to cut
# memory further); we keep the policy simple and predictable: "op" recomputes no FLOP-heavy op, and whoever
# needs less memory picks an integer option or full AC. The amax reduction (`max`) of float8 scaling is saved
# because it is a scalar that costs a full pass over its input; the reduce-scatter output under tensor
# parallel is saved so that recomputation never repeats a collective whose result it already has.
_SAVE_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_mm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten.max.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _save_expensive_ops(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_context():
    return create_selective_checkpoint_contexts(_save_expensive_ops)


def _wrap_full(block: nn.Module) -> nn.Module:
    # Non-reentrant checkpoint: works with torch.compile, FSDP2 hooks and inputs that do not require grad.
    wrapper = checkpoint_wrapper(block, preserve_rng_state=False)
    wrapper.recomputes_whole_block = True  # read by distributed/compile.py
    return wrapper


def recomputes_whole_block(module: nn.Module) -> bool:
    """True for a block wrapped by full AC (no policy: backward re-runs the whole forward)."""
    return getattr(module, "recomputes_whole_block", False)


def _wrap_op_level(block: nn.Module) -> nn.Module:
    return checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_op_level_context)


def _parse_selective_option(option: str) -> int | str:
    if option == "op":
        return "op"
    try:
        every = int(option)
    except ValueError:
        every = 0
    if every < 1:
        raise ValueError(
            f"--activation_checkpoint.selective_ac_option {option!r} is not valid: use 'op' or a positive "
            f"integer k (checkpoint every k-th block)"
        )
    return every


def check_ac_config(cfg: ACConfig, model_compiled: bool) -> None:
    """Raises ValueError (one line) for an AC setting that cannot run."""
    if cfg.mode == "selective":
        _parse_selective_option(cfg.selective_ac_option)
    if cfg.mode == "memory_budget":
        if not model_compiled:
            raise ValueError(
                "--activation_checkpoint.mode memory_budget is applied by the compiler: add --compile.enable "
                "with 'model' in --compile.components, or use mode full/selective"
            )
        if not 0.0 <= cfg.memory_budget <= 1.0:
            raise ValueError(
                f"--activation_checkpoint.memory_budget {cfg.memory_budget} must be in [0, 1] "
                f"(0 = recompute everything possible, 1 = save what no-AC saves)"
            )


def apply_ac(model: nn.Module, cfg: ACConfig, *, model_compiled: bool = False) -> None:
    """Wraps the transformer blocks in `model.layers` according to `cfg`, in place (before compile and FSDP)."""
    check_ac_config(cfg, model_compiled)
    if cfg.mode == "none":
        return
    if cfg.mode == "memory_budget":
        # Read by AOTAutograd's min-cut partitioner when the compiled blocks are first run.
        torch._functorch.config.activation_memory_budget = cfg.memory_budget
        logger.info(f"Activation checkpointing: compiler memory budget {cfg.memory_budget}")
        return
    option = _parse_selective_option(cfg.selective_ac_option) if cfg.mode == "selective" else 1
    wrapped = defaultdict(int)
    for position, (name, block) in enumerate(model.layers.named_children()):
        if option == "op":
            model.layers.register_module(name, _wrap_op_level(block))
            wrapped["op-level"] += 1
        elif (position + 1) % option == 0:
            model.layers.register_module(name, _wrap_full(block))
            wrapped["full"] += 1
    label = f"selective {option}" if cfg.mode == "selective" else cfg.mode
    what = ", ".join(f"{n} {kind}" for kind, n in wrapped.items()) or "none"
    logger.info(f"Activation checkpointing ({label}): {what} of {len(model.layers)} blocks checkpointed")


BLOCK_CHOICES = ("keep", "op", "full", "offload", "full_offload")
"""What a block does with the activations its backward needs: keep them, recompute the cheap ops (selective
op), recompute the whole block (full), offload them, or recompute the whole block from an offloaded input
(full_offload: the block keeps nothing in RAM)."""


def check_block_choices(mem: MemoryConfig, ac: ACConfig, n_blocks: int) -> None:
    """Raises ValueError (one line) for per-block choices, or a budget, that cannot run with `ac`."""
    if mem.budget_gib and mem.block_choices:
        raise ValueError("--memory.budget_gib makes the planner choose every block: drop --memory.block_choices "
                         "(or the budget, to choose by hand)")
    per_block = "--memory.budget_gib" if mem.budget_gib else "--memory.block_choices" if mem.block_choices else None
    if per_block and ac.mode != "none":
        raise ValueError(f"{per_block} decides recomputation per block and cannot compose with "
                         f"--activation_checkpoint.mode {ac.mode}: set it to none")
    for option, known in (("block_choices", BLOCK_CHOICES), ("plan_choices", (*BLOCK_CHOICES, "optimizer"))):
        unknown = [c for c in getattr(mem, option) if c not in known]
        if unknown:
            raise ValueError(f"--memory.{option} {unknown[0]!r} is not a choice: use {', '.join(known)}")
    if not set(mem.plan_choices) & set(BLOCK_CHOICES):
        raise ValueError(f"--memory.plan_choices is empty: give some of {', '.join(BLOCK_CHOICES)}")
    if len(mem.block_choices) not in (0, 1, n_blocks):
        raise ValueError(f"--memory.block_choices has {len(mem.block_choices)} entries for a model of {n_blocks} "
                         f"blocks: give one per block, or one for all")


def apply_block_choices(model: nn.Module, choices: list[str], device: torch.device,
                        offload_dir: str = "", prefetch: bool = True) -> list[ActivationOffloader]:
    """Wraps each block of `model.layers` (a whole model or a pipeline stage, whose block keys are the global
    block indices) by its choice, in place (before compile and FSDP); returns the offloaders (none when no
    block offloads). One choice applies to every block."""
    if not choices:
        return []
    offloader = inputs = None
    counts: dict[str, int] = defaultdict(int)
    for name, block in model.layers.named_children():
        choice = choices[0] if len(choices) == 1 else choices[int(name)]
        counts[choice] += 1
        if choice == "op":
            model.layers.register_module(name, _wrap_op_level(block))
        elif choice == "full":
            model.layers.register_module(name, _wrap_full(block))
        elif choice == "offload":
            offloader = offloader or ActivationOffloader(make_tier(device, offload_dir), prefetch)
            model.layers.register_module(name, OffloadedBlock(block, offloader))
        elif choice == "full_offload":
            # The checkpoint saves its input through autograd's saved-tensor hooks, so the offloader around
            # it moves exactly that input (the recomputation's own tensors are not saved). Its own offloader
            # without prefetch: a block waits for its input's write, and reads it when its recompute starts,
            # so one input is in RAM at a time and plain offload's prefetch never holds it (the planner's
            # transient for it is one block's recomputation: planning/memory_budget.py).
            inputs = inputs or ActivationOffloader(make_tier(device, offload_dir), prefetch=False)
            model.layers.register_module(name, OffloadedBlock(_wrap_full(block), inputs))
    logger.info("Per-block memory choices: " + ", ".join(f"{n} {c}" for c, n in counts.items())
                + f" of {len(model.layers)} blocks")
    return [o for o in (offloader, inputs) if o is not None]
