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
resolves. The held-out median error is held_out_error.HELD_OUT_MEDIAN_ERROR; the ratios of published pairs that
differ in one choice (single_choice_pairs) are predicted within ~6% (compile: x1.22 for x1.16 published)."""


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


_TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (the torchtitan paper's, arXiv 2410.06511, runs)"
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
              "recipe of the time: bf16 all-gather); with async TP 876", "H100-96GB",
              features=Features(float8=True, eager_loss=True)),
    Published("Llama 3.1 405B, 512 H100", "405B", 512, 8192, 256, 8, 8, 1, 128,
              f"{_TT} Table 5: FSDP 8 x TP 8 x PP 8, local batch 32, global 256, full AC, compile + Float8 + async "
              "TP (the 405B recipe of the time: float8 all-gather); Interleaved 1F1B 128 (1F1B: 100)", "H100-96GB",
              features=Features(float8=True, float8_all_gather=True, async_tp=True, eager_loss=True)),
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


LLAMA2_SHAPES = {
    # Llama 2 (arXiv 2307.09288, Table 1 and the released configs): dim, SwiGLU hidden, k/v width, heads,
    # vocabulary, layers; 4,096-token sequences.
    "Llama 2 13B": ModelShape(5120, 13824, 5120, 40, 32000, 40),
    "Llama 2 70B": ModelShape(8192, 28672, 1024, 64, 32000, 80),
}


def model_shape(model: str) -> ModelShape:
    """A registered Llama 3 flavor ("8B") or a Llama 2 shape (LLAMA2_SHAPES)."""
    return LLAMA2_SHAPES[model] if model in LLAMA2_SHAPES else ModelShape.from_args(llama3_flavors[model])


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    """One published training run, with everything it fixed, and what it reported. The layout is the one it
    ran (degrees, AC, batch split, schedule, microbatches as that code's defaults made them); `source` quotes
    the table and what the run's text fixed; `assumed` says what the source leaves open and how it was set."""

    name: str
    model: str
    device: str
    devices: int
    seq_len: int
    global_batch_size: int
    layout: Layout
    tokens_per_s: float
    """Reported tokens/s per GPU (for the Llama 3 paper: its TFLOP/s per GPU / flops_per_token)."""
    source: str
    features: Features = Features()
    network: Network = FLAT_NETWORK
    memory_gib: float | None = None
    """Reported peak memory per GPU (torchtitan: max reserved, GiB), where published; compared with
    MemoryEstimate.allocator_reserved."""
    assumed: str = ""
    kv_repeated: bool = False
    """The code of the run repeated k/v to the query heads before attention (torchtitan's Llama until 2025:
    `repeat_kv` before `F.scaled_dot_product_attention`), so its ring CP gathered n_heads of k/v."""
    pp_outputs_kept: bool = False
    """The run's torch kept every microbatch's output on the last pipeline stage until the step ended
    (`PipelineStage.output_chunks`, for the schedule's return value: torch before 2025 always did;
    RankWork.pp_kept_outputs)."""

    def predict(self) -> Candidate:
        """The model's prediction for the layout as it ran, memory not judged (it ran). CP is priced as the run
        did it: ring attention (the only CP method torch had then; torchtitan's context_parallel), over the k/v
        heads its attention received."""
        shape = model_shape(self.model)
        roomy = dataclasses.replace(get_device(self.device), memory_bytes=float("inf"))
        return evaluate(shape, self.layout, roomy, self.devices, self.seq_len, self.global_batch_size,
                        network=self.network, features=self.features, cp_method=("ring", 0),
                        cp_kv_heads=shape.n_heads if self.kv_repeated else None,
                        pp_outputs_kept=self.pp_outputs_kept)

    @property
    def choices(self) -> tuple:
        """What a user chooses at a fixed setting: the layout (degrees, AC, batch split, schedule) and the
        features (compile, Float8, async TP)."""
        return (self.layout, self.features)

    @property
    def setting(self) -> tuple:
        """What the run fixed that is not a choice: model, devices, network, sequence, global batch."""
        return (self.model, self.device, self.devices, self.network, self.seq_len, self.global_batch_size)


_DEC24 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (github.com/pytorch/torchtitan; the torchtitan "
          "paper's (arXiv 2410.06511) tables as rerun in Dec 2024): Grand Teton, 8 H100 96GB HBM2e per host at a "
          "500 W limit, NVLink, 400 Gb/s RDMA per GPU; seq 8192 unless stated")
_H200 = ("torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md (Trainy, June 2025): 8 H200 per host, NVLink, "
         "400 Gb/s RDMA per GPU; llama3_8b.toml (seq 8192, selective op AC), local batch 2, compile, Float8 with "
         "float8 all-gather and precomputed scales")
_A100 = ("torchtitan docs/performance.md (2024 version, github.com/pytorch/torchtitan): FSDP2 on 64 A100 80GB, "
         "no compile, no Float8")
_A100_NET = "the host network is not stated: 200 Gb/s per GPU (hardware.py A100) assumed"
_ATP = ("torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (PyTorch team, June 2025; its table is an "
        "image, transcribed as text in torchtitan/models/llama3/README.md): Grand Teton, 8 H100 96GB HBM2e per host "
        "at a 500 W limit, NVLink, 400 Gb/s RDMA per GPU; seq 8192 (the recipes'), torch.compile, FSDP x TP 8")
_OP_TT = ("torchtitan's op SAC of the time recomputes every other matmul (op_half_matmuls)")
# torchtitan's train.py of Dec 2024 left the loss eager under --training.compile (Features.eager_loss).
_EAGER = Features(eager_loss=True)
_COMPILE = Features(compile=True, eager_loss=True)
_F8 = Features(float8=True, compile=True, eager_loss=True)
_F8_ATP = Features(float8=True, async_tp=True, compile=True, eager_loss=True)
_F8_ALL = Features(float8=True, float8_all_gather=True, async_tp=True, compile=True, eager_loss=True)


def _tt_pp_default(local_batch: int, pp: int) -> int:
    """The microbatch size torchtitan's default of Dec 2024 gave: as many microbatches as the PP degree, for
    every schedule (pytorch/torchtitan PR #781, merged 2025-01-07, changed it to the number of stages)."""
    return local_batch // pp


CORPUS = (
    # Table 1: Llama 3.1 8B, 8 GPUs, FSDP, local batch 2, global 16, selective (op) AC.
    PublishedRun("T1 8B 8 GPUs FSDP", "8B", "H100-96GB", 8, 8192, 16, Layout(1, 8, 1, 1, 1, "op_half_matmuls", 2),
                 5762, f"{_DEC24}, Table 1 row FSDP", _EAGER, memory_gib=82.4, assumed=_OP_TT),
    PublishedRun("T1 8B 8 GPUs FSDP + compile", "8B", "H100-96GB", 8, 8192, 16,
                 Layout(1, 8, 1, 1, 1, "op_half_matmuls", 2), 6667, f"{_DEC24}, Table 1 row FSDP + torch.compile",
                 _COMPILE, memory_gib=77.0, assumed=_OP_TT),
    PublishedRun("T1 8B 8 GPUs FSDP + compile + Float8", "8B", "H100-96GB", 8, 8192, 16,
                 Layout(1, 8, 1, 1, 1, "op_half_matmuls", 2), 8532,
                 f"{_DEC24}, Table 1 row FSDP + torch.compile + Float8", _F8, memory_gib=76.8,
                 assumed=f"{_OP_TT}; bf16 all-gather (the 8B recipe's default then)"),
    # Table 2: Llama 3.1 8B, 8 GPUs, FSDP + CP + compile + Float8, local batch 1, full AC.
    *(PublishedRun(f"T2 8B 8 GPUs FSDP {8 // cp} CP {cp} seq {seq}", "8B", "H100-96GB", 8, seq, 8 // cp,
                   Layout(1, 8 // cp, cp, 1, 1, "full", 1), tps, f"{_DEC24}, Table 2 row FSDP {8 // cp}, CP {cp}",
                   _F8, memory_gib=mem, assumed="global batch = local batch 1 x FSDP degree; bf16 all-gather",
                   kv_repeated=True)
      for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                (8, 262144, 548, 84.5))),
    # Table 3: Llama 3.1 8B, 128 GPUs, FSDP, local batch 2, global 256, selective (op) AC.
    PublishedRun("T3 8B 128 GPUs FSDP", "8B", "H100-96GB", 128, 8192, 256,
                 Layout(1, 128, 1, 1, 1, "op_half_matmuls", 2), 5605, f"{_DEC24}, Table 3 row FSDP", _EAGER,
                 memory_gib=67.0,
                 assumed=_OP_TT),
    PublishedRun("T3 8B 128 GPUs FSDP + compile", "8B", "H100-96GB", 128, 8192, 256,
                 Layout(1, 128, 1, 1, 1, "op_half_matmuls", 2), 6514, f"{_DEC24}, Table 3 row FSDP + torch.compile",
                 _COMPILE, memory_gib=62.0, assumed=_OP_TT),
    PublishedRun("T3 8B 128 GPUs FSDP + compile + Float8", "8B", "H100-96GB", 128, 8192, 256,
                 Layout(1, 128, 1, 1, 1, "op_half_matmuls", 2), 8380,
                 f"{_DEC24}, Table 3 row FSDP + torch.compile + Float8", _F8, memory_gib=61.8, assumed=_OP_TT),
    # Table 4: Llama 3.1 70B, 256 GPUs, FSDP 32 x TP 8, compile + Float8, local batch 16, global 512, full AC.
    PublishedRun("T4 70B 256 GPUs FSDP 32 TP 8", "70B", "H100-96GB", 256, 8192, 512, Layout(1, 32, 1, 8, 1, "full", 16),
                 829, f"{_DEC24}, Table 4 row 2D", _F8, memory_gib=71.9,
                 assumed="bf16 all-gather (the 70B recipe's default then)"),
    PublishedRun("T4 70B 256 GPUs FSDP 32 TP 8 + async TP", "70B", "H100-96GB", 256, 8192, 512,
                 Layout(1, 32, 1, 8, 1, "full", 16), 876, f"{_DEC24}, Table 4 row 2D + AsyncTP", _F8_ATP,
                 memory_gib=67.6, assumed="bf16 all-gather (the 70B recipe's default then)"),
    # Table 5: Llama 3.1 405B, 512 GPUs (FSDP 8, TP 8, PP 8), compile + Float8 + async TP, local batch 32,
    # global 256, full AC.
    PublishedRun("T5 405B 512 GPUs 1F1B", "405B", "H100-96GB", 512, 8192, 256,
                 Layout(1, 8, 1, 8, 8, "full", 32, _tt_pp_default(32, 8), "1F1B"), 100,
                 f"{_DEC24}, Table 5 row 1F1B", _F8_ALL, memory_gib=82.5,
                 assumed="microbatches = PP degree (torchtitan's default then: 8 of 4); float8 all-gather (the "
                         "405B recipe's then)", pp_outputs_kept=True),
    PublishedRun("T5 405B 512 GPUs Interleaved 1F1B", "405B", "H100-96GB", 512, 8192, 256,
                 Layout(1, 8, 1, 8, 8, "full", 32, _tt_pp_default(32, 8), "Interleaved1F1B"), 128,
                 f"{_DEC24}, Table 5 row Interleaved 1F1B", _F8_ALL, memory_gib=72.7,
                 assumed="2 stages per rank and microbatches = PP degree (torchtitan's defaults then: 8 of 4; "
                         "first entered as 16 of 2, corrected from PR #781 after the held-out miss); float8 all-gather", pp_outputs_kept=True),
    # Table 6: Llama 3.1 405B, 512 GPUs (TP 8, PP 8), FSDP x CP = 8, compile + Float8 + async TP + 1F1B, local
    # batch 8, full AC.
    *(PublishedRun(f"T6 405B 512 GPUs FSDP {8 // cp} CP {cp} seq {seq}", "405B", "H100-96GB", 512, seq, 8 * (8 // cp),
                   Layout(1, 8 // cp, cp, 8, 8, "full", 8, _tt_pp_default(8, 8), "1F1B"), tps,
                   f"{_DEC24}, Table 6 row FSDP {8 // cp}, CP {cp}", _F8_ALL, memory_gib=mem,
                   assumed="global batch = local batch 8 x FSDP degree; 8 microbatches of 1; float8 all-gather",
                   kv_repeated=True, pp_outputs_kept=True)
      for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                (8, 262144, 16, 84.9))),
    # H200: Llama 3.1 8B, FSDP over 4 and 8 hosts.
    PublishedRun("H200 8B 32 GPUs FSDP + compile + Float8", "8B", "H200-141GB", 32, 8192, 64,
                 Layout(1, 32, 1, 1, 1, "op_half_matmuls", 2), 10938, f"{_H200}, row NUM_NODES 4",
                 Features(float8=True, float8_all_gather=True, compile=True), memory_gib=47.96, assumed=_OP_TT),
    PublishedRun("H200 8B 64 GPUs FSDP + compile + Float8", "8B", "H200-141GB", 64, 8192, 128,
                 Layout(1, 64, 1, 1, 1, "op_half_matmuls", 2), 10753, f"{_H200}, row NUM_NODES 8",
                 Features(float8=True, float8_all_gather=True, compile=True), memory_gib=46.97, assumed=_OP_TT),
    # A100: Llama 3 at seq 8192, local batch 1 (global 64); Llama 2 at seq 4096.
    PublishedRun("A100 Llama 3 8B, selective layer AC", "8B", "A100-80GB", 64, 8192, 64, Layout(1, 64, 1, 1, 1, "2", 1),
                 2904, f"{_A100}, Llama 3 table row 8B / selective layer",
                 assumed=f"selective layer = full AC on every 2nd block (the recipe's option then); {_A100_NET}"),
    PublishedRun("A100 Llama 3 8B, selective op AC", "8B", "A100-80GB", 64, 8192, 64,
                 Layout(1, 64, 1, 1, 1, "op_half_matmuls", 1), 2973, f"{_A100}, Llama 3 table row 8B / selective op",
                 assumed=f"{_OP_TT}; {_A100_NET}"),
    PublishedRun("A100 Llama 3 70B, full AC", "70B", "A100-80GB", 64, 8192, 64, Layout(1, 64, 1, 1, 1, "full", 1), 331,
                 f"{_A100}, Llama 3 table row 70B / full", assumed=_A100_NET),
    PublishedRun("A100 Llama 2 13B, no AC", "Llama 2 13B", "A100-80GB", 64, 4096, 128, Layout(1, 64, 1, 1, 1, "none", 2),
                 2162, f"{_A100}, Llama 2 table row 13B / no", assumed=_A100_NET),
    PublishedRun("A100 Llama 2 13B, selective layer AC", "Llama 2 13B", "A100-80GB", 64, 4096, 128,
                 Layout(1, 64, 1, 1, 1, "2", 2), 1914, f"{_A100}, Llama 2 table row 13B / selective layer",
                 assumed=f"selective layer = full AC on every 2nd block; {_A100_NET}"),
    PublishedRun("A100 Llama 2 13B, selective op AC", "Llama 2 13B", "A100-80GB", 64, 4096, 128,
                 Layout(1, 64, 1, 1, 1, "op_half_matmuls", 2), 1904, f"{_A100}, Llama 2 table row 13B / selective op",
                 assumed=f"{_OP_TT}; {_A100_NET}"),
    PublishedRun("A100 Llama 2 70B, selective op AC, local batch 1", "Llama 2 70B", "A100-80GB", 64, 4096, 64,
                 Layout(1, 64, 1, 1, 1, "op_half_matmuls", 1), 355, f"{_A100}, Llama 2 table row 70B 1 / selective op",
                 assumed=f"{_OP_TT}; {_A100_NET}"),
    PublishedRun("A100 Llama 2 70B, full AC, local batch 2", "Llama 2 70B", "A100-80GB", 64, 4096, 128,
                 Layout(1, 64, 1, 1, 1, "full", 2), 353, f"{_A100}, Llama 2 table row 70B 2 / full", assumed=_A100_NET),
    # Llama 3 paper (arXiv 2407.21783) Table 4: 405B, bf16, seq 8192, 16M tokens per batch, TFLOP/s per GPU.
    PublishedRun("Llama 3 405B, 8,192 GPUs", "405B", "H100-80GB", 8192, 8192, 2048,
                 Layout(1, 64, 1, 8, 16, "op", 32, 1, "Interleaved1F1B", layers_per_stage=1),
                 430e12 / flops_per_token(_405B, 8192), f"{_LLAMA3}: 430 TFLOP/s/GPU at TP 8, CP 1, PP 16, DP 64",
                 network=LLAMA3_RDMA_CLUSTER,
                 assumed="schedule and AC not published: interleaved with 1 layer per virtual stage, microbatches of "
                         "1 sequence, op AC; 700 W H100 SXM 80GB; TFLOP/s / (6 x params + 12 x layers x width x seq)"),
    PublishedRun("Llama 3 405B, 16,384 GPUs", "405B", "H100-80GB", 16384, 8192, 2048,
                 Layout(1, 128, 1, 8, 16, "op", 16, 1, "Interleaved1F1B", layers_per_stage=1),
                 400e12 / flops_per_token(_405B, 8192), f"{_LLAMA3}: 400 TFLOP/s/GPU at TP 8, CP 1, PP 16, DP 128",
                 network=LLAMA3_RDMA_CLUSTER,
                 assumed="as the 8,192-GPU run"),
    # Added after the fitting rule and after every figure above was printed (docs/planning.md, "Runs added after
    # the rule"): at the end, so the runs above keep their split. torchtitan's async-TP benchmark of June 2025
    # (vanilla TP, then async TP, each in bf16 and Float8 tensorwise), as torchtitan's Llama 3 README gives its
    # table in text.
    *(PublishedRun(f"ATP {model} {devices} GPUs FSDP {devices // 8} TP 8{' + Float8' if f8 else ''}"
                   f"{' + async TP' if atp else ''}", model, "H100-96GB", devices, 8192, devices // 8 * lbs,
                   Layout(1, devices // 8, 1, 8, 1, ac, lbs), tps,
                   f"{_ATP}; row {model} ({devices} H100s) {'Float8 tensorwise' if f8 else 'BF16'}, "
                   f"{'Async' if atp else 'Vanilla'} TP",
                   Features(float8=f8, async_tp=atp, compile=True),
                   assumed=f"{assumed}; the recipe's bf16 all-gather (no --float8.enable_fsdp_float8_all_gather in "
                           "the command)" if f8 else assumed)
      for model, devices, ac, lbs, assumed, rows in (
          ("70B", 256, "full", 16, "global batch = local batch 16 x FSDP 32", ((False, 597, 652), (True, 810, 942))),
          ("8B", 64, "op_half_matmuls", 12, f"global batch = local batch 12 x FSDP 8; {_OP_TT}",
           ((False, 4378, 4809), (True, 5078, 5570))))
      for f8, vanilla, async_ in rows for atp, tps in ((False, vanilla), (True, async_))),
)
"""The corpus, in a fixed order (source, then table, then row). Left out, with the reason (docs/planning.md):
the Llama 3 paper's 131K-sequence row (CP 16: its TFLOP/s -> tokens/s depends by ~40% on whether causal
attention is counted half, which the paper does not say); Megatron-LM's and MaxText's scaling tables (GPT blocks
and TPUs: shapes and devices this model does not describe yet); NeMo's Megatron-Core table (a virtual-pipeline
split torch cannot make, TP/CP overlap priced exposed here, AC not stated); MoE runs (no all-to-all in the
step-time model). torchtitan's async-TP benchmark of June 2025, first left out because its table is an image,
was added after the rule (the last 8 runs) from torchtitan's Llama 3 README, which gives that table in text."""

TRAINING = CORPUS[0::2]
"""The fitting rule, fixed before any prediction was looked at: every other run in corpus order, starting
with the first, is training data (the only runs fit_constants sees); the rest are held out."""
HELD_OUT = CORPUS[1::2]


def fit_constants(runs=TRAINING) -> dict[str, float]:
    """The model's fitted constants, from `runs` only, one at a time, each by a grid search minimizing the
    squared log error of predicted tokens/s over its subset:
      1. step_time.TRAINING_KERNEL_EFF (0.6-1.0) on the runs on full-power devices (all but the 500 W
         H100 96GB) without CP;
      2. hardware.H100_500W_CLOCK_FRACTION on the H100 96GB runs without CP, bracketed by the source
         ("between SXM and NVL": H100 NVL's 835 of SXM's 989 TFLOP/s, 0.84, to 1.0);
      3. step_time.CP_RING_STEP_OVERHEAD (0-0.5) on the runs with CP.
    Returns their values (tests/unit/test_planner.py checks the stored ones are these)."""
    import math

    from torchtitan.planning import hardware, step_time

    saved = (step_time.TRAINING_KERNEL_EFF, step_time.CP_RING_STEP_OVERHEAD, hardware.DEVICES["H100-96GB"])

    def set_(name: str, value: float) -> None:
        if name == "H100_500W_CLOCK_FRACTION":
            hardware.DEVICES["H100-96GB"] = dataclasses.replace(saved[2], clock_fraction=value)
        else:
            setattr(step_time, name, value)

    def grid(name, subset, lo, hi, step):
        best = None
        for i in range(int(round((hi - lo) / step)) + 1):
            value = round(lo + i * step, 4)
            set_(name, value)
            err = sum(math.log(r.predict().tokens_per_s_per_device / r.tokens_per_s) ** 2 for r in subset)
            if best is None or err < best[0]:
                best = (err, value)
        set_(name, best[1])
        return best[1]

    fitted = {}
    try:
        set_("CP_RING_STEP_OVERHEAD", 0.0)
        fitted["TRAINING_KERNEL_EFF"] = grid(
            "TRAINING_KERNEL_EFF", [r for r in runs if r.device != "H100-96GB" and r.layout.cp == 1], 0.6, 1.0, 0.01)
        fitted["H100_500W_CLOCK_FRACTION"] = grid(
            "H100_500W_CLOCK_FRACTION", [r for r in runs if r.device == "H100-96GB" and r.layout.cp == 1],
            0.84, 1.0, 0.01)
        fitted["CP_RING_STEP_OVERHEAD"] = grid(
            "CP_RING_STEP_OVERHEAD", [r for r in runs if r.layout.cp > 1], 0.0, 0.5, 0.01)
    finally:
        step_time.TRAINING_KERNEL_EFF, step_time.CP_RING_STEP_OVERHEAD, hardware.DEVICES["H100-96GB"] = saved
    return fitted


def single_choice_pairs(runs=CORPUS) -> list[tuple[PublishedRun, PublishedRun, str]]:
    """Published pairs at the same setting that differ in one choice: the layout (degrees, AC, batch split,
    schedule) or one feature (compile, Float8, async TP). Returns (a, b, what differs)."""
    pairs = []
    for i, a in enumerate(runs):
        for b in runs[i + 1:]:
            if a.setting != b.setting or a.features.eager_loss != b.features.eager_loss:
                continue  # (an eager or compiled loss is the code of the time, late 2024 or 2025: not a choice)
            fa, fb = dataclasses.asdict(a.features), dataclasses.asdict(b.features)
            feats = [k for k in fa if fa[k] != fb[k]]
            la, lb = dataclasses.asdict(a.layout), dataclasses.asdict(b.layout)
            fields = [k for k in la if la[k] != lb[k]]
            if a.layout == b.layout and len(feats) == 1:
                pairs.append((a, b, feats[0]))
            elif a.features == b.features and fields:
                # a schedule change brings the microbatches that schedule defaulted to; that is one choice
                if set(fields) <= {"schedule", "microbatch_size"} and "schedule" in fields:
                    pairs.append((a, b, "schedule"))
                elif fields == ["ac"]:
                    pairs.append((a, b, "ac"))
                elif set(fields) <= {"dp_replicate", "dp_shard", "cp", "tp", "pp"}:
                    pairs.append((a, b, "layout"))
    return pairs


def _feature_key(f: Features) -> tuple:
    return (f.float8, f.float8_all_gather, f.async_tp, f.compiled)


def published_here(shape: ModelShape, device_name: str, devices: int, seq_len: int, global_batch_size: int,
                   features: Features, ranked: list[Candidate]) -> list[str]:
    """For each corpus run at this setting and with these features: where its degrees rank among `ranked`
    and why (the step-time terms that separate them from #1), with the published and predicted throughput."""
    lines = []
    for run in CORPUS:
        if (model_shape(run.model), run.device.lower(), run.devices, run.seq_len, run.global_batch_size,
                _feature_key(run.features)) != (shape, device_name.lower(), devices, seq_len, global_batch_size,
                                                _feature_key(features)):
            continue
        deg = (run.layout.tp, run.layout.pp, run.layout.cp)
        rank = next((i for i, c in enumerate(ranked, 1) if (c.layout.tp, c.layout.pp, c.layout.cp) == deg), None)
        split = "held out" if run in HELD_OUT else "training"
        head = (f"published ({run.name}; {split}): {run.layout.describe()}, {run.tokens_per_s:,.0f} tokens/s/GPU; "
                f"this model predicts it at {run.predict().tokens_per_s_per_device:,.0f}")
        if rank is None:
            lines.append(f"{head}; its degrees do not fit or divide here (memory is judged, the run's was not)")
        elif rank == 1:
            lines.append(f"{head}; its degrees rank #1")
        else:
            best, ours = ranked[0], ranked[rank - 1]
            gap = ours.time.total / best.time.total - 1
            why = (f"a tie (within {100 * TIE:.0f}%)" if gap < TIE else
                   f"{100 * gap:.0f}% slower than #1; seconds per step, its degrees vs #1: {time_diff(ours, best)}")
            lines.append(f"{head}; its degrees rank #{rank}: {why}")
    return lines
