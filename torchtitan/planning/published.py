"""Published training layouts the planner is checked against, and the comparison with its ranking
(tests/unit/test_planner.py, scripts/planning/published_layouts.py, docs/planning.md).

Each case gives the planner what the run fixed (model, devices, device type, network, sequence length,
global batch) and asks for the degrees; the AC mode, batch split and schedule stay free.
"""

import dataclasses

from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.planning.hardware import FLAT_NETWORK, LLAMA3_RDMA_CLUSTER, Network, get_device
from torchtitan.planning.memory import ModelShape
from torchtitan.planning.planner import Candidate, PlanResult, evaluate, flops_per_token, plan_layouts

TIE = 0.05
"""Layouts whose predicted step times differ by less than this fraction are a tie: below what the model
resolves. What it leaves out (torch.compile, Float8, async TP, NCCL kernels taking SMs from overlapped
compute, a power cap) each moves a layout's throughput by 5-30% (docs/planning.md), and its predicted /
published throughput ratios spread from 0.7 to 1.5."""


@dataclasses.dataclass(frozen=True)
class Published:
    """A layout someone trained with, and the throughput they reported (tokens/s/GPU)."""

    name: str
    flavor: str
    devices: int
    seq_len: int
    global_batch_size: int
    tp: int
    pp: int
    cp: int
    tokens_per_s: float
    """Reported tokens/s/GPU, or FLOP/s/GPU converted with this model's flops_per_token."""
    source: str
    device: str = "H100-80GB"
    network: Network = FLAT_NETWORK

    def describe(self) -> str:
        dp = self.devices // (self.tp * self.pp * self.cp)
        return " x ".join(f"{n} {v}" for n, v in (("pp", self.pp), ("dp", dp), ("cp", self.cp), ("tp", self.tp)) if v > 1)

    def matches(self, c: Candidate) -> bool:
        """The published degrees (FSDP or HSDP for the data-parallel part, any AC, batch split, schedule)."""
        return (c.layout.tp, c.layout.pp, c.layout.cp) == (self.tp, self.pp, self.cp)


_TT = "torchtitan paper (arXiv 2410.06511) = torchtitan docs/performance.md"
_405B = ModelShape(16384, 53248, 1024, 128, 128256, 126)
PUBLISHED = (
    Published("Llama 3.1 8B, 8 H100", "8B", 8, 8192, 16, 1, 1, 1, 5762,
              f"{_TT} Table 1: FSDP 8, local batch 2, global 16, selective (op) AC, bf16, no compile",
              "H100-96GB"),
    Published("Llama 3.1 70B, 256 H100", "70B", 256, 8192, 512, 8, 1, 1, 829,
              f"{_TT} Table 4: FSDP 32 x TP 8, local batch 16, global 512, full AC, compile + Float8", "H100-96GB"),
    Published("Llama 3.1 405B, 512 H100", "405B", 512, 8192, 256, 8, 8, 1, 100,
              f"{_TT} Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, global 256, full AC, 1F1B, compile + Float8 "
              "+ async TP (Interleaved 1F1B: 128)", "H100-96GB"),
    Published("Llama 3 405B, 16K H100", "405B", 16384, 8192, 2048, 8, 16, 1,
              400e12 / flops_per_token(_405B, 8192),
              "Llama 3 paper (arXiv 2407.21783) Table 4: 400 TFLOP/s/GPU (38% MFU) at TP 8, CP 1, PP 16, DP 128, "
              "8K sequences, 16M tokens (2,048 sequences) per batch; converted with flops_per_token",
              "H100-80GB", LLAMA3_RDMA_CLUSTER),
)


@dataclasses.dataclass
class Comparison:
    case: Published
    result: PlanResult
    rank: int | None
    """1-based rank of the best candidate with the published degrees; None = none fits."""
    gap: float
    """Its predicted step time / the planner's first choice's - 1."""
    reason: str


def compare(case: Published) -> Comparison:
    """Plan the case and say where its published layout lands, and why when it is not first."""
    device = get_device(case.device)
    shape = ModelShape.from_args(llama3_flavors[case.flavor])
    result = plan_layouts(shape, device, case.devices, case.seq_len, case.global_batch_size, network=case.network)
    rank = next((i for i, c in enumerate(result.ranked, 1) if case.matches(c)), None)
    if rank is None:
        return Comparison(case, result, None, float("inf"), "the published degrees do not fit or divide")
    best, ours = result.ranked[0], result.ranked[rank - 1]
    gap = ours.time.total / best.time.total - 1
    if rank == 1:
        reason = "the planner's first choice"
    elif gap < TIE:
        reason = f"a tie: {100 * gap:.1f}% slower than #1, below what the model resolves ({100 * TIE:.0f}%)"
    else:
        reason = _why_slower(case, shape, device, best, ours)
    return Comparison(case, result, rank, gap, reason)


def _why_slower(case, shape, device, best: Candidate, ours: Candidate) -> str:
    """The step-time terms that separate the published degrees' best layout from #1, and (under PP) the
    memory limit that keeps those degrees from the finer interleaving that would shrink their bubble."""
    why = (f"{100 * (ours.time.total / best.time.total - 1):.0f}% slower than #1 "
           f"({best.layout.describe()}); seconds per step, published degrees vs #1: {time_diff(ours, best)}")
    if ours.layout.pp > 1:  # finer interleaving would shrink the bubble: say why the planner did not take it
        tight = []
        for lps in (1, 2, 4):
            finer = dataclasses.replace(ours.layout, schedule="Interleaved1F1B", layers_per_stage=lps)
            try:
                evaluate(shape, finer, device, case.devices, case.seq_len, case.global_batch_size, network=case.network)
            except MemoryError as e:
                tight.append(f"{lps} layers per stage: {e}")
            except LayoutError:  # a split the pipeline planner rejects is no option either
                pass
        if tight:
            why += f"; with finer interleaving (a smaller bubble) these degrees do not fit ({'; '.join(tight)})"
    return why


def time_diff(a: Candidate, b: Candidate) -> str:
    """The step-time terms in which two candidates differ by more than 1% of b's step, largest first."""
    terms = {"compute": (a.time.compute, b.time.compute),
             "bubble": (a.time.compute * a.time.bubble, b.time.compute * b.time.bubble)}
    for k in {*a.time.exposed, *b.time.exposed}:
        terms[f"{k} exposed"] = (a.time.exposed.get(k, 0.0), b.time.exposed.get(k, 0.0))
    big = sorted(((abs(x - y), k, x, y) for k, (x, y) in terms.items() if abs(x - y) > 0.01 * b.time.total),
                 reverse=True)
    return ", ".join(f"{k} {x:.2f} vs {y:.2f}" for _, k, x, y in big)
