"""Data parallelism with FSDP2: sharded (FSDP), hybrid (HSDP) and replicate-only (DDP).

Replicate-only is FSDP2 over a (replicate=N, shard=1) mesh: full parameters on every rank, gradients
all-reduced, the same mixed-precision policy and gradient semantics as FSDP.

Gradients are SUMMED across data-parallel ranks (divide factor 1): the trainer already divides every
rank's loss by the token count of the whole global batch, so a sum is the global mean.
"""

from collections.abc import Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard


def _reshard_policy(policy: str, is_last: bool, pp_enabled: bool) -> bool:
    if policy == "always":
        return True
    if policy == "never":
        return False
    # default: reshard everything but the last group, whose parameters backward needs immediately. Under
    # pipeline parallel never: a stage runs forward and backward for many microbatches with the same
    # parameters, and the pipeline schedule unshards/reshards whole stages itself. Zero-bubble schedules
    # even require it: their weight-gradient pass reuses the parameters captured in the input pass.
    return not is_last and not pp_enabled


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str = "default",
    cpu_offload: bool = False,
    pp_enabled: bool = False,
    expert_modules: Sequence[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shards each transformer block, the embedding, and norm+output as separate FSDP groups, then the root
    (the embedding joins the norm+output group when it shares its weight with the output).

    dp_mesh is 1-D for FSDP and 2-D (replicate, shard) for HSDP. The model must expose `layers` (a
    ModuleDict) and may have `tok_embeddings`, `norm`, `output` (absent on pipeline stages).

    Under expert parallel, `expert_modules` (already split over ep) are their own FSDP groups over
    `expert_mesh` (the ranks sharing the same experts), or left out of FSDP when that is None: their
    gradients are then complete on their ep rank (see distributed/expert_parallel.py).
    """
    kw = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy() if cpu_offload else None,
    )
    if kw["offload_policy"] is None:
        del kw["offload_policy"]
    if expert_modules and expert_mesh is not None:
        for experts in expert_modules:
            fully_shard(experts, **{**kw, "mesh": expert_mesh},
                        reshard_after_forward=_reshard_policy(reshard_after_forward, False, pp_enabled))
    elif expert_modules:
        kw["ignored_params"] = {p for experts in expert_modules for p in experts.parameters()}
    layers = list(model.layers.values())
    head = getattr(model, "tok_embeddings", None)
    tail = [m for m in (getattr(model, "norm", None), getattr(model, "output", None)) if m is not None]
    if head is not None and _share_a_parameter(head, tail):
        # Tied input/output embeddings are one parameter, which one FSDP group must own (FSDP refuses a parameter
        # shared across groups at the first forward). The group lives from the embedding to the output.
        tail, head = [head, *tail], None
    if head is not None:
        fully_shard(head, **kw, reshard_after_forward=_reshard_policy(reshard_after_forward, False, pp_enabled))
    for i, block in enumerate(layers):
        last = i == len(layers) - 1 and getattr(model, "output", None) is None
        fully_shard(block, **kw, reshard_after_forward=_reshard_policy(reshard_after_forward, last, pp_enabled))
    if tail:
        fully_shard(tail, **kw, reshard_after_forward=_reshard_policy(reshard_after_forward, True, pp_enabled))
    fully_shard(model, **kw, reshard_after_forward=_reshard_policy(reshard_after_forward, True, pp_enabled))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # Plain SUM collectives: gloo has no PREMUL_SUM, and NCCL's zero-copy path needs SUM too.
            m.set_force_sum_reduction_for_comms(True)
    return model


def _share_a_parameter(module: nn.Module, others: list[nn.Module]) -> bool:
    mine = {id(p) for p in module.parameters()}
    return any(id(p) in mine for m in others for p in m.parameters())
