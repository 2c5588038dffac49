"""torch.compile of the model (per transformer block) and of the loss, and async tensor parallel.

Regional compilation: each transformer block is compiled on its own (`Module.compile`, which keeps parameter
names unchanged) rather than the whole model. All blocks share one graph (dynamo treats a block's parameters as
graph inputs), so compile time does not grow with depth, and the FSDP2 hooks and pipeline cuts between blocks
stay outside the graphs. `fullgraph=True`: a block that breaks the graph is a bug to fix, not a silent slowdown.
A block holding what cannot be traced inside it (a context-parallel attention kernel, experts FSDP-sharded apart
from their block) is compiled part by part around it (`apply_compile`, docs/compile.md).

Order in a parallelizer: TP ▸ AC ▸ compile ▸ FSDP. Compile sees the TP-sharded (DTensor) block and the AC
wrapper, and FSDP then wraps the compiled blocks.

Compiled artefacts are cached on disk (`TORCHINDUCTOR_CACHE_DIR`, default `$TORCHTITAN_CACHE_DIR/inductor` or
`~/.cache/torchtitan/inductor`), so a second run of the same shapes, a test suite or a CI job that already ran
once loads kernels instead of compiling them.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch._functorch.config
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig
from torchtitan.distributed.activation_checkpoint import recomputes_whole_block
from torchtitan.tools.logging import logger

COMPONENTS = ("model", "loss")
BACKENDS = ("inductor", "aot_eager")


def configure_compile_cache() -> str:
    """Sets up the on-disk compile cache and returns its folder.

    Folder: $TORCHINDUCTOR_CACHE_DIR, set here to the project cache if unset, one folder per CPU kernel set
    (ATen's capability: avx512, avx2, ...; ATEN_CPU_CAPABILITY changes it). Inductor's CPU code takes its vector
    ISA from that capability but its FX graph cache key does not include it, so a graph compiled for AVX-512 was
    loaded under the AVX2 caps and gave NaN logits (tests/unit/test_document_masking.py, measured).

    Set through the environment (not inductor's config) so that spawned ranks and compile workers inherit it.
    Importing torch._dynamo, which almost any torch code does (even building a model on meta), writes torch's
    own default (/tmp/torchinductor_$USER, lost at reboot) into the variable, so that value counts as unset.
    Inductor reads the variable whenever it opens its caches, so setting it before the first compile suffices.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        base = os.environ.get("TORCHTITAN_CACHE_DIR", str(Path.home() / ".cache" / "torchtitan"))
        isa = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(base) / "inductor" / isa)
    # Inductor's FX graph cache stays on; AOTAutograd's cache is turned off. With tensor parallel its key does
    # not tell ranks apart (pytorch/pytorch#188390: DTensor cache keys omit the rank; on CPU every rank's
    # device is "cpu"), so a rank loads another rank's graph: measured, a warm-cache TP 2 run logged loss 2.20
    # instead of 8.12 (tests/distributed/test_compile.py). The FX graph cache alone keeps a warm start within
    # a second of what both caches give.
    torch._functorch.config.enable_autograd_cache = False
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def compiles(job_config: JobConfig, component: str) -> bool:
    return job_config.compile.enable and component in job_config.compile.components


def check_compile_config(job_config: JobConfig, device_type: str) -> None:
    """Raises ValueError (one line) for compile / async-TP settings that cannot run."""
    unknown = [c for c in job_config.compile.components if c not in COMPONENTS]
    if unknown:
        raise ValueError(
            f"--compile.components {','.join(unknown)} unknown; choose from {','.join(COMPONENTS)}"
        )
    if job_config.compile.backend not in BACKENDS:
        raise ValueError(f"--compile.backend {job_config.compile.backend!r} unknown; choose from {', '.join(BACKENDS)}")
    if job_config.parallelism.enable_async_tensor_parallel:
        why = None
        if device_type != "cuda":
            why = f"it needs CUDA GPUs with symmetric memory (this run is on {device_type})"
        elif not compiles(job_config, "model"):
            why = "it is done by the compiler: add --compile.enable with 'model' in --compile.components"
        elif job_config.parallelism.tensor_parallel_degree <= 1:
            why = "tensor parallel is off: set --parallelism.tensor_parallel_degree > 1"
        if why:
            raise ValueError(f"--parallelism.enable_async_tensor_parallel cannot be used: {why}")


def _wait_for_async_output(module: nn.Module, inputs, output):
    # Under TP the embedding's output is an AsyncCollectiveTensor (its reduce-scatter still in flight). Fed to a
    # compiled block, its gradient comes back as a plain tensor where DTensor's backward needs a DTensor
    # (torch 2.13: AttributeError '_local_tensor'). A clone waits for the collective inside autograd, so the
    # block gets a plain tensor and the gradient path to the embedding stays intact. (`.wait()` would cut it.)
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else None


def apply_compile(model: nn.Module, *, eager: Sequence[nn.Module] = (), apart: Sequence[nn.Module] = (),
                  backend: str = "inductor") -> None:
    """Compiles each transformer block of `model.layers` in place, whole (fullgraph) where it can be traced.

    `eager`: modules that must run outside any graph (context-parallel attention kernels: ring attention skips
    blocks by their values and shifts k/v point to point, which dynamo cannot trace). `apart`: modules with
    their own FSDP group inside a block (routed experts sharded over dp_shard_mod_ep), whose FSDP2 hooks cannot
    run inside another module's graph. A block holding either is compiled around them (`_compile_around`)."""
    configure_compile_cache()
    eager_ids, apart_ids = {id(m) for m in eager}, {id(m) for m in apart}
    for m in eager:
        # The caller's graph breaks here and resumes after; the kernel and its collectives run eagerly.
        m.forward = torch.compiler.disable(m.forward, recursive=True)
    split = 0
    for block in model.layers.values():
        # An offloaded block compiles the block inside, so its saved-tensor hooks stay outside the graph.
        target = getattr(block, "compile_target", block)
        if any(id(m) in eager_ids or id(m) in apart_ids for m in target.modules()):
            _compile_around(_unwrapped(target), eager_ids, apart_ids, backend)
            split += 1
        elif recomputes_whole_block(target) and any(isinstance(p, DTensor) for p in target.parameters()):
            # A full-AC wrapper stays eager around a tensor-parallel block (compiled whole inside it). Traced,
            # the checkpoint makes AOTAutograd's partitioner recompute the attention kernel in backward; SDPA
            # is tagged random (its dropout), so the partitioner stashes an RNG state for it and appends it to
            # the forward's outputs after the saved DeviceMesh (an opaque object), where AOTAutograd expects
            # only symints: "expected all tensors_saved_with_vc_check to be Tensors, got ... DeviceMesh"
            # (torch 2.13, functionalize_rng_ops in torch/_functorch/partitioners.py). Eager around the
            # compiled block, the checkpoint still keeps only the block's input and re-runs the compiled
            # forward in backward: full AC's memory and numbers. Op-level AC traces (it saves the attention).
            _unwrapped(target).compile(fullgraph=True, backend=backend)
        else:
            target.compile(fullgraph=True, backend=backend)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_async_output)
    how = f", {split} of them part by part (context-parallel kernels or separately sharded experts)" if split else ""
    logger.info(f"Compiling {len(model.layers)} transformer blocks{how} (cache: {configure_compile_cache()})")


def _unwrapped(block: nn.Module) -> nn.Module:
    # An activation-checkpoint wrapper stays eager around compiled parts: a graph break inside a traced
    # checkpoint would make the compiler run the whole checkpointed block eagerly.
    return getattr(block, "_checkpoint_wrapped_module", block)


def _compile_around(block: nn.Module, eager_ids: set[int], apart_ids: set[int], backend: str) -> None:
    """Compiles the parts of a block that holds an `eager` or `apart` module (what upstream torchtitan does for
    MoE blocks): each child of the block on its own; an MoE child's own children (router, shared experts,
    the experts with their FSDP hooks) each on its own, its routing glue and all-to-all eager; a child holding
    an eager kernel (the attention under context parallel) with a graph break at the kernel. torch's own
    modules (nn.RMSNorm, nn.Linear) stay eager when alone: dynamo does not trace into torch's files from the
    top frame, and one op alone has nothing to fuse."""

    def compile_part(part: nn.Module, fullgraph: bool = True) -> None:
        if id(part) not in eager_ids and not type(part).__module__.startswith("torch."):
            part.compile(fullgraph=fullgraph, backend=backend)

    for child in block.children():
        inside = [m for m in child.modules() if m is not child]
        if any(id(m) in apart_ids for m in inside):
            for part in child.children():
                compile_part(part)
        else:
            compile_part(child, fullgraph=not any(id(m) in eager_ids for m in inside))


def compile_loss(loss_fn, backend: str = "inductor"):
    """The loss compiled: fuses the fp32 upcast of the logits into the softmax instead of materialising it."""
    configure_compile_cache()
    logger.info("Compiling the loss")
    return torch.compile(loss_fn, backend=backend)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Lets inductor overlap TP all-gathers / reduce-scatters with the matmuls they feed (micro-pipelining
    through symmetric memory). Must run before the blocks are first compiled."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("Async tensor parallel enabled")
