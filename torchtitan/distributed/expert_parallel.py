"""Expert parallelism: each of the `ep` ranks holds num_experts / ep routed experts, and token copies
travel to the rank of their expert and back with one variable-split all-to-all each way.

    tokens sorted by expert ─▶ all-to-all (splits: copies per destination rank) ─▶ regroup by local expert
    ─▶ local experts ─▶ undo the regrouping ─▶ all-to-all back (the reverse splits) ─▶ combine in MoE

The ep ranks hold different tokens (they are taken from the data-parallel, cp and tp ranks, see
parallel_dims), so an expert's gradient on its rank already sums every token routed to it: experts need no
gradient reduction over ep, only over the ranks FSDP shards them across (dp_shard_mod_ep).

Expert tensor parallel (TP with EP 1; upstream torchtitan's and Megatron's ETP) splits every expert over the tp
ranks instead: each rank holds a slice of every expert's hidden units (w1/w3 column-wise, w2 row-wise, like a
dense FFN under TP) and runs it on every tp rank's tokens.

    this rank's sequence shard ─▶ router (its own tokens, as under EP) ─▶ all-gather over tp: tokens,
    routed weights, expert ids ─▶ experts' hidden slices ─▶ combine ─▶ + shared experts (sharded alike)
    ─▶ partial sums ─▶ reduce-scatter over tp ─▶ this rank's sequence shard

Per MoE layer that is one all-gather of the tokens and one reduce-scatter of the output (a dense FFN's TP traffic)
plus the routing decisions ([tokens, top_k] weights and ids); backward the mirror image. Every quantity a
rank's slice feeds is a partial sum over tp: its gradient (the tokens', the routed weights', the shared gate's)
is summed over tp by the collectives' backward or declared Partial, and an output bias on the row-sharded
projection (GPT-OSS's down_bias) is added by tp rank 0 only (components/moe/experts.py `_added_once`).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, SequenceParallel

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


class ExpertTensorParallel:
    """MoE.expert_tp under expert tensor parallel (the module docstring): every tp rank's routed tokens in, this
    rank's shard of the summed output out. Functional collectives, so a compiled block traces them."""

    def __init__(self, tp_mesh: DeviceMesh):
        self.group = tp_mesh.get_group()

    def gather(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # Sequence shards are dim 1 of [B, S / tp, ...]: the gathered tokens are in the order of the whole
        # sequence, as one process holds them. Backward, the routed weights' and the tokens' gradients (partial
        # sums over the hidden slices) are reduce-scattered back to their shard.
        bs, k = x.shape[0], weights.shape[-1]
        x = funcol.all_gather_single_autograd(x, gather_dim=1, group=self.group)
        weights = funcol.all_gather_single_autograd(weights.view(bs, -1, k), gather_dim=1, group=self.group)
        ids = funcol.all_gather_single_autograd(ids.view(bs, -1, k), gather_dim=1, group=self.group)
        return x, weights.reshape(-1, k), ids.reshape(-1, k)

    def reduce(self, out: torch.Tensor) -> torch.Tensor:
        return funcol.reduce_scatter_single_autograd(out, "sum", scatter_dim=1, group=self.group)


class _ExpertTokensOverTP(ParallelStyle):
    """The MoE module under expert tensor parallel: takes its input as this rank's sequence shard (a plain
    tensor) and gathers the experts' tokens over tp (ExpertTensorParallel)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                           use_local_output=True)._apply(module, device_mesh)
        module.expert_tp = ExpertTensorParallel(device_mesh)
        return module


class _ExpertsHiddenOverTP(ParallelStyle):
    """Routed experts under expert tensor parallel: each parameter the experts module lists in `hidden_dims`
    (name -> the dim of its hidden units) becomes Shard(that dim) over tp, the others Replicate (an output bias:
    added once, by tp rank 0). The experts compute with the local slices (experts.py `_local`)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hidden = module.hidden_dims
        for name, p in list(module.named_parameters(recurse=False)):
            placement = Shard(hidden[name]) if name in hidden else Replicate()
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, device_mesh, [placement])))
        return module


class _PartialSumLinear(ParallelStyle):
    """An nn.Linear of the shared experts under expert tensor parallel, on plain tensors of every tp rank's
    tokens: `weight` its placement over tp; the input arrives as `input_layout` and its gradient is handed back
    as `input_grad` (Partial: a partial sum that the token gather's backward reduces); the output leaves as a
    plain tensor whose gradient is declared `output_grad`.

    column: weight Shard(0), input replicated (gradient Partial), output this rank's hidden units;
    row: weight Shard(1), input this rank's hidden units, output a partial sum (its gradient the full one);
    gate: weight replicated, output replicated but multiplying a partial sum (gradient Partial)."""

    def __init__(self, weight: Placement, input_layout: Placement, input_grad: Placement, output_grad: Placement):
        super().__init__()
        self.weight, self.input_layout = weight, input_layout
        self.input_grad, self.output_grad = input_grad, output_grad

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, p in list(module.named_parameters(recurse=False)):
            placement = self.weight if pname == "weight" or self.weight == Shard(0) else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [placement])))

    def _input(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        x = DTensor.from_local(x, mesh, [_last_dim(self.input_layout, x.ndim)], run_check=False,
                               grad_placements=[_last_dim(self.input_grad, x.ndim)])
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return output.to_local(grad_placements=[_last_dim(self.output_grad, output.ndim)])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._input, self._output)


def _last_dim(p: Placement, ndim: int) -> Placement:
    """Shard(-1) (the features of a [..., features] input) as DTensor wants it, with a non-negative dim."""
    return Shard(ndim - 1) if isinstance(p, Shard) and p.dim == -1 else p


SHARED_COLUMN = _PartialSumLinear(Shard(0), Replicate(), Partial(), Shard(-1))
SHARED_ROW = _PartialSumLinear(Shard(1), Shard(-1), Shard(-1), Replicate())
SHARED_GATE = _PartialSumLinear(Replicate(), Replicate(), Partial(), Partial())


def moe_tp_plan(moe: MoE, name: str = "moe", *, experts_over_tp: bool) -> dict:
    """Tensor-parallel plan entries for an MoE layer at `name` inside a block. Under sequence parallel each tp
    rank routes its own sequence shard: the router gate is a replicated DTensor reading the shard, its gradient
    summed over the tp ranks.

    experts_over_tp False (EP x TP: the experts are split over ep, which includes tp): the MoE runs on the shard;
    the shared experts (and Qwen3.5's shared gate) are replicated like the gate.
    experts_over_tp True (expert tensor parallel, EP 1): every expert's hidden units and the shared experts' are
    split over tp (w1/w3 column-wise, w2 row-wise), the experts see every tp rank's tokens, and the output is
    reduce-scattered back to the shard (ExpertTensorParallel)."""
    shard_in = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)
    plan = {
        name: _ExpertTokensOverTP() if experts_over_tp else shard_in,
        f"{name}.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    }
    replicated = SequenceParallel(sequence_dim=1, use_local_output=True)
    if experts_over_tp:
        plan[f"{name}.experts"] = _ExpertsHiddenOverTP()
    if moe.shared_experts is not None:
        for w, column in (("w1", True), ("w2", False), ("w3", True)):
            style = (SHARED_COLUMN if column else SHARED_ROW) if experts_over_tp else replicated
            plan[f"{name}.shared_experts.{w}"] = style
    if getattr(moe, "shared_gate", None) is not None:
        plan[f"{name}.shared_gate"] = SHARED_GATE if experts_over_tp else replicated
    return plan
