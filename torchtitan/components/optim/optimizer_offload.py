"""Optimizer-state offload on CPU: between steps the optimizer's state (AdamW's two moments) lives in files,
and each step streams it through RAM one chunk of parameters at a time (--memory.offload_optimizer, or the
budget planner when parameters + optimizer state break the budget; docs/memory_budget.md).

A chunk is the parameters of one top-level module: one transformer block (`layers.N`), the embedding, the final
norm, the output projection. `OffloadedOptimizerState.step(optimizer)` runs, per chunk: read its state back
(prefetched while the chunk before it stepped), step the optimizer on that chunk only (its param groups
restricted to the chunk's parameters, the hyperparameters the LR schedule set shared), start writing the
chunk's new state to a file and drop it from the optimizer. The moves go through the activation offload's file
tier (distributed/activation_offload.FileTier: one background thread, pages dropped from the page cache), so
at most three chunks' states are in RAM at once: the one stepping, the next one being read and the previous one
being written (RESIDENT_CHUNKS; the planner counts them).

Numbers: AdamW/Adam are element-wise, so stepping chunk by chunk computes every element as one step over all
parameters does, from the same bytes restored exactly: weights and losses are bitwise equal to the run
without offload (tests/unit/test_optimizer_offload.py). Scalar state (the step counter) stays resident.

Does not compose (refused in one line before any rank starts, job_plan): checkpointing (the state is in files
between steps, and DCP reads it from the optimizer), Muon (its step gathers whole matrices across ranks), CUDA
(use --training.enable_cpu_offload: FSDP2's CPUOffloadPolicy, parameters, gradients and optimizer state on the
host; the planner does not choose it).
"""

from concurrent.futures import Future

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.distributed.activation_offload import FileTier

RESIDENT_CHUNKS = 3
"""Chunks whose optimizer state is in RAM at once during a step (see the module docstring)."""


def check_optimizer_offload(cfg, device_type: str) -> None:
    """Raises ValueError (one line) when --memory.offload_optimizer cannot run with the job's other options."""
    if not cfg.memory.offload_optimizer:
        return
    if device_type == "cuda":
        raise ValueError("--memory.offload_optimizer streams the optimizer state from files on CPU runs; on CUDA use "
                         "--training.enable_cpu_offload (FSDP2's CPU offload policy) instead")
    if cfg.checkpoint.enable:
        raise ValueError("--memory.offload_optimizer keeps the optimizer state in files between steps, which "
                         "checkpointing does not read: drop it or --checkpoint.enable")
    if cfg.optimizer.name not in ("AdamW", "Adam"):
        raise ValueError(f"--memory.offload_optimizer steps the optimizer one block's parameters at a time, which "
                         f"{cfg.optimizer.name} (whole-matrix steps across ranks) cannot: use AdamW or drop it")


def chunk_key(fqn: str) -> str:
    """The chunk of a parameter: its transformer block (`layers.N`) or its top-level module."""
    parts = fqn.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else parts[0]


def parameter_chunks(model: nn.Module) -> list[list[nn.Parameter]]:
    """The trainable parameters of `model` grouped by chunk_key, in the model's order."""
    chunks: dict[str, list[nn.Parameter]] = {}
    for fqn, p in model.named_parameters():
        if p.requires_grad:
            # FSDP/compile/AC wrappers add prefixes; the chunk is named after the model's own path
            clean = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            chunks.setdefault(chunk_key(clean), []).append(p)
    return list(chunks.values())


class _Chunk:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ids = {id(p) for p in params}
        self.layout: list[tuple] = []  # (param, state key, dtype, shape, stride, offset in buffer, DTensor spec)
        self.written: Future | None = None
        self.nbytes = 0
        self.loading: Future | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class OffloadedOptimizerState:
    """The optimizer state of one model part in files between steps, streamed per chunk in `step`."""

    def __init__(self, model: nn.Module, directory: str = ""):
        self.tier = FileTier(directory)
        self.chunks = [_Chunk(c) for c in parameter_chunks(model)]

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        groups = optimizer.param_groups
        try:
            for i, chunk in enumerate(self.chunks):
                self._restore(optimizer, chunk)
                if i + 1 < len(self.chunks):  # read the next chunk's state while this one steps
                    self._start_read(self.chunks[i + 1])
                optimizer.param_groups = [
                    {**g, "params": [p for p in g["params"] if id(p) in chunk.ids]} for g in groups
                ]
                optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
                optimizer.step()
                optimizer.param_groups = groups
                self._offload(optimizer, chunk)
        finally:
            optimizer.param_groups = groups

    def _start_read(self, chunk: _Chunk) -> None:
        if chunk.written is not None and chunk.loading is None:
            chunk.loading = self.tier.read(chunk.written, chunk.nbytes)

    def _restore(self, optimizer: torch.optim.Optimizer, chunk: _Chunk) -> None:
        if chunk.written is None:
            return  # first step: the optimizer creates the state
        self._start_read(chunk)
        buf = chunk.loading.result()
        for p, key, dtype, size, stride, offset, spec in chunk.layout:
            elem = torch.empty((), dtype=dtype).element_size()
            t = torch.empty(0, dtype=dtype).set_(buf.untyped_storage(), offset // elem, size, stride)
            optimizer.state[p][key] = DTensor(t, spec, requires_grad=False) if spec is not None else t
        chunk.written = chunk.loading = None

    def _offload(self, optimizer: torch.optim.Optimizer, chunk: _Chunk) -> None:
        # Restored moments are views of one buffer: each storage is written once, and each tensor is put back
        # at its own offset in it (as activation offload does)
        storages, starts, layout, total = [], {}, [], 0
        for p in chunk.params:
            state = optimizer.state.get(p, {})
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor) or _local(value).numel() <= 1:
                    continue  # the step counter and scalars stay resident
                local = _local(value)
                storage = local.untyped_storage()
                if storage.data_ptr() not in starts:
                    starts[storage.data_ptr()] = total
                    storages.append(storage)
                    total += -(-storage.nbytes() // 64) * 64  # the tier's alignment
                offset = starts[storage.data_ptr()] + local.storage_offset() * local.element_size()
                layout.append((p, key, local.dtype, local.size(), local.stride(), offset,
                               value._spec if isinstance(value, DTensor) else None))
                del state[key]
        if storages:
            chunk.layout = layout
            chunk.written, chunk.nbytes = self.tier.write(storages)
            assert chunk.nbytes == total

    def load_all(self, optimizer: torch.optim.Optimizer) -> None:
        """Brings every chunk's state back into the optimizer (and stops offloading it until the next step)."""
        for chunk in self.chunks:
            self._restore(optimizer, chunk)

    def close(self) -> None:
        self.tier.close()
