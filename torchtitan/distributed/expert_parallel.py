"""Expert parallelism: each of the `ep` ranks holds num_experts / ep routed experts, and token copies
travel to the rank of their expert and back with one variable-split all-to-all each way.

    tokens sorted by expert ─▶ all-to-all (splits: copies per destination rank) ─▶ regroup by local expert
    ─▶ local experts ─▶ undo the regrouping ─▶ all-to-all back (the reverse splits) ─▶ combine in MoE

The ep ranks hold different tokens (they are taken from the data-parallel, cp and tp ranks, see
parallel_dims), so an expert's gradient on its rank already sums every token routed to it: experts need no
gradient reduction over ep, only over the ranks FSDP shards them across (dp_shard_mod_ep).
"""

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from torchtitan.components.moe.experts import GroupedExperts
from torchtitan.components.moe.moe import MoE


class AllToAllDispatch:
    """MoE.token_dispatch under expert parallel (see the module docstring)."""

    def __init__(self, ep_mesh: DeviceMesh):
        self.group = ep_mesh.get_group()
        self.ep = ep_mesh.size()

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """x [N, dim]: this rank's token copies sorted by global expert id, counts[e] for expert e."""
        n_local = counts.numel() // self.ep
        with torch.no_grad():
            # received[r, j]: copies rank r sends to this rank's local expert j.
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=self.group)
            received = received.view(self.ep, n_local)
            send_splits = counts.view(self.ep, n_local).sum(1).tolist()
            recv_splits = received.sum(1).tolist()
            # Arrivals are ordered (source rank, local expert); the experts want them by local expert.
            expert_of = torch.arange(n_local, device=x.device).repeat(self.ep).repeat_interleave(received.flatten())
            by_expert = expert_of.argsort(stable=True)
            back = by_expert.argsort()
        arrived = all_to_all_single_autograd(x, recv_splits, send_splits, self.group)
        out = experts(arrived[by_expert], received.sum(0))[back]
        return all_to_all_single_autograd(out, send_splits, recv_splits, self.group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Splits every MoE layer's routed experts over `ep_mesh` (DTensors sharded on the expert dim) and
    switches its dispatch to the all-to-all. Returns the expert modules (FSDP shards them separately)."""
    experts = []
    for moe in (m for m in model.modules() if isinstance(m, MoE)):
        for name, p in list(moe.experts.named_parameters(recurse=False)):
            moe.experts.register_parameter(name, nn.Parameter(distribute_tensor(p, ep_mesh, [Shard(0)])))
        moe.token_dispatch = AllToAllDispatch(ep_mesh)
        experts.append(moe.experts)
    return experts


def moe_tp_plan(moe: MoE, name: str = "moe") -> dict:
    """Tensor-parallel plan entries for an MoE layer at `name` inside a block: under sequence parallel each
    tp rank routes its own sequence shard (the experts are split over ep, which includes tp). The router
    gate and the shared experts are replicated DTensors reading the shard, so their gradients are summed
    over the tp ranks."""
    plan = {
        name: PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True),
        f"{name}.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    }
    if moe.shared_experts is not None:
        for w in ("w1", "w2", "w3"):
            plan[f"{name}.shared_experts.{w}"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if getattr(moe, "shared_gate", None) is not None:
        plan[f"{name}.shared_gate"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    return plan
