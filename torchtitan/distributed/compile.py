"""torch.compile of the model (per transformer block) and of the loss, and async tensor parallel.

Regional compilation: each transformer block is compiled on its own (`Module.compile`, which keeps parameter
names unchanged) rather than the whole model. All blocks share one graph (dynamo treats a block's parameters as
graph inputs), so compile time does not grow with depth, and the FSDP2 hooks and pipeline cuts between blocks
stay outside the graphs. `fullgraph=True`: a block that breaks the graph is a bug to fix, not a silent slowdown.

Order in a parallelizer: TP ▸ AC ▸ compile ▸ FSDP. Compile sees the TP-sharded (DTensor) block and the AC
wrapper, and FSDP then wraps the compiled blocks.

Compiled artefacts are cached on disk (`TORCHINDUCTOR_CACHE_DIR`, default `$TORCHTITAN_CACHE_DIR/inductor` or
`~/.cache/torchtitan/inductor`), so a second run of the same shapes, a test suite or a CI job that already ran
once loads kernels instead of compiling them.
"""

import os
from pathlib import Path

import torch
import torch._functorch.config
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

COMPONENTS = ("model", "loss")


def configure_compile_cache() -> str:
    """Sets up the on-disk compile cache and returns its folder.

    Folder: $TORCHINDUCTOR_CACHE_DIR, set here to the project cache if unset.

    Set through the environment (not inductor's config) so that spawned ranks and compile workers inherit it.
    Importing torch._dynamo, which almost any torch code does (even building a model on meta), writes torch's
    own default (/tmp/torchinductor_$USER, lost at reboot) into the variable, so that value counts as unset.
    Inductor reads the variable whenever it opens its caches, so setting it before the first compile suffices.
    """
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, default_cache_dir()):
        base = os.environ.get("TORCHTITAN_CACHE_DIR", str(Path.home() / ".cache" / "torchtitan"))
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(base) / "inductor")
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


def check_compile_layout(job_config: JobConfig, parallel_dims) -> None:
    """Raises ValueError (one line) for layouts whose blocks cannot be compiled whole (fullgraph); plan_job
    calls it once the degrees are resolved."""
    if not compiles(job_config, "model"):
        return
    pd = parallel_dims
    if pd.cp > 1:
        # Ring attention (distributed/context_parallel.py) skips fully masked blocks by their values and shifts
        # k/v with point-to-point ops: dynamo can trace neither (torch 2.13 stops on `mask.any()`).
        raise ValueError(
            f"--compile.enable cannot compile the blocks under --parallelism.context_parallel_degree {pd.cp}: ring "
            f"attention's point-to-point shifts and data-dependent block skipping do not trace; turn one of them off"
        )
    expert_fsdp = pd.dp_replicate * pd.dp_shard_mod_ep
    if pd.ep > 1 and expert_fsdp > 1:
        # Those experts are their own FSDP group inside the compiled block; FSDP2's hooks are not traced.
        raise ValueError(
            f"--compile.enable with --parallelism.expert_parallel_degree {pd.ep}: the experts are FSDP-sharded "
            f"apart from their block over {expert_fsdp} ranks, and FSDP's hooks would break the compiled block; "
            f"set --parallelism.expert_parallel_degree {pd.dp_shard * pd.cp * pd.tp} (with no replicate degree) so "
            f"no rank shares another's experts, or turn compile off"
        )


def _wait_for_async_output(module: nn.Module, inputs, output):
    # Under TP the embedding's output is an AsyncCollectiveTensor (its reduce-scatter still in flight). Fed to a
    # compiled block, its gradient comes back as a plain tensor where DTensor's backward needs a DTensor
    # (torch 2.13: AttributeError '_local_tensor'). A clone waits for the collective inside autograd, so the
    # block gets a plain tensor and the gradient path to the embedding stays intact. (`.wait()` would cut it.)
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else None


def apply_compile(model: nn.Module) -> None:
    """Compiles each transformer block of `model.layers` in place."""
    configure_compile_cache()
    for block in model.layers.values():
        # An offloaded block compiles the block inside, so its saved-tensor hooks stay outside the graph.
        getattr(block, "compile_target", block).compile(fullgraph=True)
    if getattr(model, "tok_embeddings", None) is not None:
        model.tok_embeddings.register_forward_hook(_wait_for_async_output)
    logger.info(f"Compiling {len(model.layers)} transformer blocks (cache: {configure_compile_cache()})")


def compile_loss(loss_fn):
    """The loss compiled: fuses the fp32 upcast of the logits into the softmax instead of materialising it."""
    configure_compile_cache()
    logger.info("Compiling the loss")
    return torch.compile(loss_fn)


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Lets inductor overlap TP all-gathers / reduce-scatters with the matmuls they feed (micro-pipelining
    through symmetric memory). Must run before the blocks are first compiled."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    logger.info("Async tensor parallel enabled")
