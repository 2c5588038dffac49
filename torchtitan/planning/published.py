"""Published training layouts the planner is checked against, and the comparison with its ranking
(tests/unit/test_planner.py, scripts/planning/published_layouts.py, docs/planning.md).

Each case gives the planner what the run fixed (model, devices, device type, network, sequence length,
global batch, and the features it trained with: Float8, float8 all-gather, async TP) and asks for the
degrees; the AC mode, batch split and schedule stay free.
"""

import dataclasses

from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.models.llama3 import llama3_flavors
from torchtitan.planning.hardware import FLAT_NETWORK, LLAMA3_RDMA_CLUSTER, Network, get_device
from torchtitan.planning.memory import ModelShape
from torchtitan.planning.planner import (
    Candidate,
    Features,
    Layout,
    PlanResult,
    evaluate,
    flops_per_token,
    model_parallel_dims,
    plan_layouts,
)

TIE = 0.05
"""Layouts whose predicted step times differ by less than this fraction are a tie: below what the model
resolves. Where its relative predictions hold, they are within 3% of published pairs (RATIOS); what it
leaves out (NCCL kernels taking SMs from overlapped compute, compile's fusions beyond a uniform speedup, a
power cap, the memory compile and Float8 change) moves layouts by more than that."""


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
    features: Features = Features()

    def describe(self) -> str:
        dp = self.devices // (self.tp * self.pp * self.cp)
        return " x ".join(f"{n} {v}" for n, v in (("pp", self.pp), ("dp", dp), ("cp", self.cp), ("tp", self.tp)) if v > 1)

    @property
    def model_parallel(self) -> frozenset[str]:
        return model_parallel_dims(self)

    def matches(self, c: Candidate) -> bool:
        """The published degrees (FSDP or HSDP for the data-parallel part, any AC, batch split, schedule)."""
        return (c.layout.tp, c.layout.pp, c.layout.cp) == (self.tp, self.pp, self.cp)


_TT = "torchtitan paper (arXiv 2410.06511) = torchtitan docs/performance.md"
_LLAMA3 = ("Llama 3 paper (arXiv 2407.21783) Table 4: bf16, 8K sequences, 16M tokens (2,048 sequences) per batch; "
           "TFLOP/s/GPU converted to tokens/s with flops_per_token")
_405B = ModelShape(16384, 53248, 1024, 128, 128256, 126)
PUBLISHED = (
    Published("Llama 3.1 8B, 8 H100", "8B", 8, 8192, 16, 1, 1, 1, 5762,
              f"{_TT} Table 1: FSDP 8, local batch 2, global 16, selective (op) AC, bf16, no compile",
              "H100-96GB"),
    Published("Llama 3.1 8B, 128 H100", "8B", 128, 8192, 256, 1, 1, 1, 5605,
              f"{_TT} Table 3: FSDP 128, local batch 2, global 256, selective (op) AC, bf16, no compile",
              "H100-96GB"),
    Published("Llama 3.1 70B, 256 H100", "70B", 256, 8192, 512, 8, 1, 1, 829,
              f"{_TT} Table 4: FSDP 32 x TP 8, local batch 16, global 512, full AC, compile + Float8 (the 70B "
              "recipe of the time: bf16 all-gather); with async TP 876", "H100-96GB", features=Features(float8=True)),
    Published("Llama 3.1 405B, 512 H100", "405B", 512, 8192, 256, 8, 8, 1, 128,
              f"{_TT} Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, global 256, full AC, compile + Float8 + async "
              "TP (the 405B recipe of the time: float8 all-gather); Interleaved 1F1B 128 (1F1B: 100)", "H100-96GB",
              features=Features(float8=True, float8_all_gather=True, async_tp=True)),
    Published("Llama 3 405B, 16K H100", "405B", 16384, 8192, 2048, 8, 16, 1,
              400e12 / flops_per_token(_405B, 8192), f"{_LLAMA3}: 400 TFLOP/s/GPU at TP 8, CP 1, PP 16, DP 128",
              "H100-80GB", LLAMA3_RDMA_CLUSTER),
    Published("Llama 3 405B, 8K H100", "405B", 8192, 8192, 2048, 8, 16, 1,
              430e12 / flops_per_token(_405B, 8192), f"{_LLAMA3}: 430 TFLOP/s/GPU at TP 8, CP 1, PP 16, DP 64",
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
    within: tuple[int, float, Candidate] | None = None
    """Among the layouts that use the published run's parallelisms (the same model-parallel dimensions), the
    published degrees' rank, their gap to the first of those, and that first."""


def compare(case: Published, memory_headroom: float = 0.0) -> Comparison:
    """Plan the case and say where its published layout lands, and why when it is not first.
    `memory_headroom`: the fraction of memory every layout must leave free (the planner's option)."""
    device = get_device(case.device)
    shape = ModelShape.from_args(llama3_flavors[case.flavor])
    result = plan_layouts(shape, device, case.devices, case.seq_len, case.global_batch_size, network=case.network,
                          features=case.features, memory_headroom=memory_headroom)
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
        reason = _why_slower(case, shape, device, best, ours, memory_headroom)
    same_dims = [c for c in result.ranked if c.layout.model_parallel == case.model_parallel]
    rank_within = same_dims.index(ours) + 1
    within = (rank_within, ours.time.total / same_dims[0].time.total - 1, same_dims[0])
    return Comparison(case, result, rank, gap, reason, within)


def _why_slower(case, shape, device, best: Candidate, ours: Candidate, memory_headroom: float) -> str:
    """The step-time terms that separate the published degrees' best layout from #1, and (under PP) the
    memory limit that keeps those degrees from the finer interleaving that would shrink their bubble."""
    why = (f"{100 * (ours.time.total / best.time.total - 1):.0f}% slower than #1 "
           f"({best.layout.describe()}); seconds per step, published degrees vs #1: {time_diff(ours, best)}")
    if ours.layout.pp > 1:  # finer interleaving would shrink the bubble: say why the planner did not take it
        tight = []
        for lps in (1, 2, 4):
            finer = dataclasses.replace(ours.layout, schedule="Interleaved1F1B", layers_per_stage=lps)
            try:
                evaluate(shape, finer, device, case.devices, case.seq_len, case.global_batch_size,
                         network=case.network, features=case.features, memory_headroom=memory_headroom)
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


@dataclasses.dataclass(frozen=True)
class Run:
    devices: int
    global_batch_size: int
    layout: Layout
    features: Features = Features()


def _unjudged(flavor: str, device: str, run: Run, network: Network = FLAT_NETWORK) -> Candidate:
    """A published run evaluated at 8K sequences with its memory not judged (it ran)."""
    roomy = dataclasses.replace(get_device(device), memory_bytes=float("inf"))
    return evaluate(ModelShape.from_args(llama3_flavors[flavor]), run.layout, roomy, run.devices, 8192,
                    run.global_batch_size, network=network, features=run.features)


@dataclasses.dataclass(frozen=True)
class PublishedRatio:
    """Two published runs that differ in one thing, and the ratio of their reported throughputs. The ranking
    rests on the model's relative predictions, so these check it directly. `role` says whether the pair set
    one of the model's constants (then it reproduces its own source) or only checks it."""

    name: str
    flavor: str
    a: Run
    b: Run
    published: float
    role: str
    source: str
    device: str = "H100-96GB"
    network: Network = FLAT_NETWORK

    def predicted(self) -> float:
        """Predicted throughput per GPU of b / a, memory not judged (the published runs ran; the estimator is
        checked against their memory separately, docs/planning.md)."""
        tps = [_unjudged(self.flavor, self.device, r, self.network).tokens_per_s_per_device for r in (self.a, self.b)]
        return tps[1] / tps[0]


_F8 = Features(float8=True)
_F8_ALL = Features(float8=True, float8_all_gather=True, async_tp=True)
_8B = Layout(1, 8, 1, 1, 1, "op", 2)
_8B_128 = Layout(1, 128, 1, 1, 1, "op", 2)
_70B = Layout(1, 32, 1, 8, 1, "full", 16)
_405B_PP = Layout(1, 8, 1, 8, 8, "full", 32, 1, "1F1B")
RATIOS = (
    PublishedRatio("8B, FSDP 8 -> 128 GPUs (bf16)", "8B", Run(8, 16, _8B), Run(128, 256, _8B_128), 5605 / 5762,
                   "check", f"{_TT} Tables 1 and 3, FSDP rows"),
    PublishedRatio("8B on 8 GPUs, compile -> compile + Float8", "8B", Run(8, 16, _8B), Run(8, 16, _8B, _F8),
                   8532 / 6667, "sets FLOAT8_LINEAR_SPEEDUP", f"{_TT} Table 1"),
    PublishedRatio("8B on 128 GPUs, compile -> compile + Float8", "8B", Run(128, 256, _8B_128),
                   Run(128, 256, _8B_128, _F8), 8380 / 6514, "check", f"{_TT} Table 3"),
    PublishedRatio("70B, FSDP 32 x TP 8 + Float8 -> + async TP", "70B", Run(256, 512, _70B, _F8),
                   Run(256, 512, _70B, Features(float8=True, async_tp=True)), 876 / 829, "sets ASYNC_TP_HIDDEN",
                   f"{_TT} Table 4"),
    PublishedRatio("405B, FSDP 8 x TP 8 x PP 8, 1F1B -> Interleaved 1F1B", "405B", Run(512, 256, _405B_PP, _F8_ALL),
                   Run(512, 256, dataclasses.replace(_405B_PP, schedule="Interleaved1F1B"), _F8_ALL), 128 / 100,
                   "check", f"{_TT} Table 5 (2 stages per rank, torchtitan's default then)"),
    PublishedRatio("Llama 3 405B, 8K -> 16K GPUs (DP 64 -> 128)", "405B",
                   Run(8192, 2048, Layout(1, 64, 1, 8, 16, "op", 32, 1, "Interleaved1F1B", layers_per_stage=1)),
                   Run(16384, 2048, Layout(1, 128, 1, 8, 16, "op", 16, 1, "Interleaved1F1B", layers_per_stage=1)),
                   400 / 430, "check", f"{_LLAMA3} (TFLOP/s per GPU; schedule and AC not published: 1 layer per "
                   "virtual stage and op AC assumed)", "H100-80GB", LLAMA3_RDMA_CLUSTER),
)


@dataclasses.dataclass(frozen=True)
class PublishedMemory:
    """A published run's measured peak memory per GPU, against this estimator for the same layout. None of
    these runs is this repository's code (torchtitan of 2024, with compile and Float8 for the larger ones),
    so they are not fitted; they show how far the estimate can be from a GPU (docs/planning.md)."""

    name: str
    flavor: str
    run: Run
    measured_gib: float
    source: str
    device: str = "H100-96GB"

    def estimate_gib(self) -> float:
        return _unjudged(self.flavor, self.device, self.run).memory.peak / 2**30


MEMORY = (
    PublishedMemory("8B on 8, FSDP 8, op AC, local batch 2, bf16, no compile", "8B", Run(8, 16, _8B), 82.4,
                    f"{_TT} Table 1 (torchtitan's op AC saved every other matmul; this one saves all)"),
    PublishedMemory("70B on 256, FSDP 32 x TP 8, full AC, compile + Float8", "70B", Run(256, 512, _70B, _F8), 71.9,
                    f"{_TT} Table 4"),
    PublishedMemory("405B on 512, FSDP 8 x TP 8 x PP 8, Interleaved 1F1B, full AC, compile + Float8 + async TP",
                    "405B", Run(512, 256, dataclasses.replace(_405B_PP, schedule="Interleaved1F1B"), _F8_ALL), 72.7,
                    f"{_TT} Table 5"),
    PublishedMemory("405B on 512, the same with 1F1B", "405B", Run(512, 256, _405B_PP, _F8_ALL), 82.5,
                    f"{_TT} Table 5"),
)
