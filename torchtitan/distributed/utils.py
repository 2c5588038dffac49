"""Process-group start-up and end, seeding and the global gradient norm."""

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import Comm, Debug


def init_distributed(comm: Comm) -> tuple[torch.device, int, int]:
    """Joins the process group torchrun describes (none when run as one plain process).

    Returns (device, rank, world_size). cuda+nccl when GPUs are visible, cpu+gloo otherwise.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=comm.init_timeout_seconds))
    return device, rank, world_size


def end_distributed() -> None:
    """Destroys the process groups and lets go of torch's caches that keep them, so that a gloo group's threads
    (its transport loop and two workers) end once the objects that use its meshes are gone and collected (the
    caller drops them: train.main drops the trainer after its close), not at exit.

    torch's DTensor caches the meshes it planned or propagated for (MeshTopoInfo.build_from_mesh, the
    redistribute planner and transform caches, the sharding propagation caches), and a mesh holds its process
    groups: after destroy_process_group those groups' threads ran on through the interpreter's shutdown. A gloo
    worker that released a collective's tensor then had to take the GIL while Python finalized, and Python ended
    it with pthread_exit through torch's noexcept destructor: std::terminate, SIGABRT (issue 31; reproduced by
    scripts/diagnostics/gloo_exit_probe.py). A process that goes on (tests, notebooks) also kept every run's
    sockets and threads.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    for clear in _TORCH_MESH_CACHES:
        try:
            clear()
        except (ImportError, AttributeError):  # private torch API: another torch version may lack one
            pass


def _clear_topology_cache() -> None:
    from torch.distributed.tensor._collective_utils import MeshTopoInfo

    MeshTopoInfo.build_from_mesh.cache_clear()


def _clear_redistribute_caches() -> None:
    from torch.distributed.tensor import _redistribute

    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def _clear_sharding_caches() -> None:
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


_TORCH_MESH_CACHES = (_clear_topology_cache, _clear_redistribute_caches, _clear_sharding_caches)


def set_pg_timeout(seconds: int) -> None:
    """After start-up, collectives get the (usually shorter) training timeout so a hung rank fails fast."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return  # gloo process groups cannot change their timeout after creation
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), None)


def set_determinism(debug: Debug, device: torch.device) -> int:
    """Seeds every RNG the same on all ranks; returns the seed. Deterministic kernels when asked for."""
    seed = 0 if debug.seed is None else debug.seed
    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    if debug.deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return seed


@torch.no_grad()
def clip_grad_norm_(
    parameters,
    max_norm: float,
    *,
    pp_group: dist.ProcessGroup | None = None,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Clips gradients by their true global norm and returns that norm (before clipping).

    Under FSDP/TP/EP the gradients are DTensors; each group living on one mesh has its norm reduced over
    that mesh by `full_tensor()`, so every shard counts once: dense parameters over dp_shard_cp (x tp),
    routed experts over their own ep (x dp_shard_mod_ep) mesh. Pipeline stages hold disjoint parameters, so
    their norms are combined across the pipeline group. max_norm <= 0 only measures.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite=False, foreach=True)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if math.isinf(norm_type):
        norm = torch.stack(norms).max()
    else:
        norm = (torch.stack(norms) ** norm_type).sum() ** (1.0 / norm_type)
    if pp_group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        else:
            norm = norm**norm_type
            dist.all_reduce(norm, group=pp_group)
            norm = norm ** (1.0 / norm_type)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm, foreach=True)
    return norm
