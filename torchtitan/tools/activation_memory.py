"""Measures the activation memory a forward pass leaves behind for backward, per transformer block.

What is counted: every tensor storage created during the forward (seen at the dispatcher) that is still alive
when the forward has returned, attributed to the block whose forward created it. Parameters, buffers and the
inputs existed before and are not counted; the logits (created in `model.output`) and anything after the model
are reported apart.

Why not `torch.autograd.graph.saved_tensors_hooks`: activation checkpointing installs its own saved-tensor
hooks inside each checkpointed block (the innermost hooks win, so an outer hook never sees what a block
saves), and the op-level policy keeps its saved outputs in a cache of its own. Liveness of storages sees what
every mode really holds, including the block inputs that checkpointing keeps for recomputation.
"""

from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

OUTSIDE_BLOCKS = "outside blocks"
LOGITS = "logits"


class _StorageRecorder(TorchDispatchMode):
    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing
        self.tag = OUTSIDE_BLOCKS
        self.seen: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view of an input is not a new storage: without this, a tensor made before the forward (the batch's
        # document ids) would count in the first block that slices it.
        inputs = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ref = StorageWeakRef(t.untyped_storage())
                known = self.seen.get(ref.cdata)
                # An address can be reused once its storage died: a dead entry is replaced.
                if ref.cdata not in self.existing and ref.cdata not in inputs and (known is None or known[0].expired()):
                    self.seen[ref.cdata] = (ref, t.untyped_storage().nbytes(), self.tag)
        return out

    def live_bytes(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for ref, nbytes, tag in self.seen.values():
            if not ref.expired():
                totals[tag] += nbytes
        return dict(totals)


def _tag_while_running(module: nn.Module, recorder: _StorageRecorder, tag: str) -> list:
    def enter(*_):
        recorder.tag = tag

    def leave(*_):
        recorder.tag = OUTSIDE_BLOCKS

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def activation_bytes(model: nn.Module, run_forward: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Runs `run_forward()` (which calls `model` and returns what backward would start from, e.g. the loss)
    and returns the bytes still held afterwards: one entry per block name of `model.layers`, plus
    LOGITS and OUTSIDE_BLOCKS. The result of `run_forward` is kept alive while measuring."""
    existing = {StorageWeakRef(t.untyped_storage()).cdata for t in (*model.parameters(), *model.buffers())}
    recorder = _StorageRecorder(existing)
    handles = []
    for name, block in model.layers.named_children():
        handles += _tag_while_running(block, recorder, name)
    if getattr(model, "output", None) is not None:
        handles += _tag_while_running(model.output, recorder, LOGITS)
    try:
        with recorder:
            result = run_forward()
        measured = recorder.live_bytes()
    finally:
        for h in handles:
            h.remove()
    del result
    return {name: measured.get(name, 0) for name in (*model.layers.keys(), LOGITS, OUTSIDE_BLOCKS)}
