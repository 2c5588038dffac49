"""Routed experts as stacked weights, and how their SwiGLUs run.

`expert_swiglu` is the one place that chooses the kernel: `torch._grouped_mm` (one grouped GEMM per
projection over all experts' token groups) on CUDA devices that have it for the dtype, else an exact loop
of one matmul per expert. Both compute the same function; tests/unit/test_moe.py checks they agree.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial


def grouped_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """torch._grouped_mm's CUDA kernel: bf16 on compute capability 9.0+ (Hopper). CPU builds have a
    reference implementation whose backward is unreliable, so the exact loop is used there."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def expert_swiglu(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    counts: torch.Tensor,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """x [N, dim]: tokens sorted by expert, counts[e] of them for expert e; w1/w3 [E, hidden, dim],
    w2 [E, dim, hidden]. Returns w2_e(silu(w1_e x) * w3_e x) for each token's expert, [N, dim].
    use_grouped_mm None: grouped GEMM where supported (see grouped_mm_supported)."""
    w1, w2, w3 = (w.to(x.dtype) for w in (w1, w2, w3))
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_supported(x.device, x.dtype)
    if use_grouped_mm:
        offsets = counts.cumsum(0).to(torch.int32)
        return _grouped(F.silu(_grouped(x, w1, offsets)) * _grouped(x, w3, offsets), w2, offsets)
    sizes = counts.tolist()
    # Under compile the sizes are data-dependent integers: telling the tracer they are sizes that add up to
    # the token count lets it split without guessing (a guard on them is an error under fullgraph).
    for size in sizes:
        torch._check(size >= 0)
    torch._check(sum(sizes) == x.shape[0])
    out = []
    for e, xe in enumerate(x.split(sizes)):
        out.append(F.linear(F.silu(F.linear(xe, w1[e])) * F.linear(xe, w3[e]), w2[e]))
    return torch.cat(out) if out else x.new_zeros(0, w2.shape[1])


def _local(w: torch.Tensor) -> torch.Tensor:
    # Under expert parallel the stacked weights are DTensors sharded over experts (dim 0) on the ep mesh, under
    # expert tensor parallel over their hidden units on the tp mesh (`hidden_dims`); this rank computes with its
    # own slice. The gradient returns as this rank's shard.
    return w.to_local() if isinstance(w, DTensor) else w


def _added_once(b: torch.Tensor) -> torch.Tensor:
    """A bias added after the down projection. Under expert tensor parallel the projection is split over the tp
    ranks by its input (hidden) units, so each rank's output is a partial sum that the MoE adds up over tp, and
    the bias is a replicated DTensor on the tp mesh: tp rank 0 adds it, the others add zeros, so the sum holds it
    once. Its local gradient (rank 0's, zeros elsewhere) is declared Partial: summed over tp where it is used."""
    if not isinstance(b, DTensor) or not all(p.is_replicate() for p in b.placements):
        return _local(b)
    local = b.to_local(grad_placements=[Partial()] * b.device_mesh.ndim)
    return local if not any(b.device_mesh.get_coordinate()) else local * 0


class GroupedExperts(nn.Module):
    hidden_dims = {"w1": 1, "w2": 2, "w3": 1}
    """The dim of each parameter that holds the hidden units (expert tensor parallel splits these over tp)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def init_weights(self, out_std: float) -> None:
        for w, std in ((self.w1, 0.02), (self.w2, out_std), (self.w3, out_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by (local) expert with counts[e] tokens for local expert e."""
        return expert_swiglu(x, _local(self.w1), _local(self.w2), _local(self.w3), counts)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation of a fused, interleaved gate/up projection [..., 2 x hidden] (gate at even, up at
    odd columns): the gate clamped from above and the up projection on both sides at `limit`, then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLUExperts(nn.Module):
    """GPT-OSS's routed experts, stored as its checkpoints store them (so the HF layout is a rename and every
    tensor splits over experts on dim 0, for EP, FSDP and per-rank reads): `gate_up` [E, dim, 2 x hidden]
    (gate and up interleaved by column) with `gate_up_bias` [E, 2 x hidden], `down` [E, hidden, dim] with
    `down_bias` [E, dim]; expert e computes clamped_swiglu(x gate_up_e + b) down_e + down_bias_e."""

    hidden_dims = {"gate_up": 2, "gate_up_bias": 1, "down": 1}
    """The dim of each parameter that holds the hidden units (expert tensor parallel splits these over tp: a
    slice of gate_up's columns holds whole (gate, up) pairs when tp divides hidden_dim). down_bias is added once."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float):
        super().__init__()
        self.num_experts, self.alpha, self.limit = num_experts, alpha, limit
        self.gate_up = nn.Parameter(torch.empty(num_experts, dim, 2 * hidden_dim))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_bias = nn.Parameter(torch.empty(num_experts, dim))

    def init_weights(self, out_std: float) -> None:
        for w, std in ((self.gate_up, 0.02), (self.down, out_std)):
            nn.init.trunc_normal_(w, mean=0.0, std=std, a=-3 * std, b=3 * std)
        nn.init.zeros_(self.gate_up_bias)
        nn.init.zeros_(self.down_bias)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim] sorted by (local) expert with counts[e] tokens for local expert e."""
        gate_up, gate_up_bias, down = (_local(w).to(x.dtype) for w in (self.gate_up, self.gate_up_bias, self.down))
        down_bias = _added_once(self.down_bias).to(x.dtype)
        if grouped_mm_supported(x.device, x.dtype):
            offsets = counts.cumsum(0).to(torch.int32)
            expert_of = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                                output_size=x.shape[0])
            h = torch._grouped_mm(x, gate_up, offs=offsets) + gate_up_bias[expert_of]
            h = clamped_swiglu(h, self.alpha, self.limit)
            return torch._grouped_mm(h, down, offs=offsets) + down_bias[expert_of]
        sizes = counts.tolist()
        for size in sizes:
            torch._check(size >= 0)
        torch._check(sum(sizes) == x.shape[0])
        out = []
        for e, xe in enumerate(x.split(sizes)):
            h = clamped_swiglu(xe @ gate_up[e] + gate_up_bias[e], self.alpha, self.limit)
            out.append(h @ down[e] + down_bias[e])
        return torch.cat(out) if out else x.new_zeros(0, down.shape[2])
