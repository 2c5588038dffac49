"""The layout planner: enumerate layouts, drop those that do not divide or fit, rank the rest by the
step-time model, explain the winners.

Each candidate is judged by the same code as a training job: ParallelDims for the degrees and batch
divisibility, the model shape checks of TP, plan_pipeline for the pipeline stages and microbatches, then
the memory estimator (torchtitan/planning/memory.py) for the heaviest pipeline rank and the step-time
model (torchtitan/planning/step_time.py).
"""

import dataclasses
import math

from torchtitan.config.job_config import Parallelism
from torchtitan.distributed.parallel_dims import LayoutError, ParallelDims
from torchtitan.distributed.pipeline import plan_pipeline
from torchtitan.planning.hardware import FLAT_NETWORK, LLAMA3_RDMA_CLUSTER, Device, Network
from torchtitan.planning.memory import (
    MemoryEstimate,
    ModelShape,
    RankWork,
    StateBytes,
    estimate_memory,
    in_flight_microbatches,
)
from torchtitan.planning.step_time import DEFAULT_MFU, FULL_SPEED_TOKENS, StepTime, collective_time

AC_MODES = ("none", "op", "full")
SCHEDULES = ("1F1B", "Interleaved1F1B")
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter + fp32 gradient + AdamW's two fp32 moments (training.dtype float32, bf16 compute)."""
ACT_BYTES = 2
"""bf16 activations and gathered parameters (mixed_precision_param bfloat16)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ac: str
    local_batch_size: int
    """Sequences per forward on a data-parallel rank (the whole per-step batch of a rank under PP)."""
    microbatch_size: int = 1
    """Sequences per pipeline microbatch (PP only)."""
    schedule: str = ""
    grad_accum: int = 1
    layers_per_stage: int | None = None
    """Interleaved schedules: units of compute per stage (pipeline_parallel_layers_per_stage); None = 2
    stages per rank."""

    def toml(self, seq_len: int, global_batch_size: int) -> str:
        ac = {"none": 'mode = "none"', "full": 'mode = "full"',
              "op": 'mode = "selective"\nselective_ac_option = "op"'}[self.ac]
        lines = [
            "[training]", f"seq_len = {seq_len}", f"local_batch_size = {self.local_batch_size}",
            f"global_batch_size = {global_batch_size}", "mixed_precision_param = \"bfloat16\"", "",
            "[parallelism]", f"data_parallel_replicate_degree = {self.dp_replicate}",
            f"data_parallel_shard_degree = {self.dp_shard}", f"tensor_parallel_degree = {self.tp}",
            f"context_parallel_degree = {self.cp}", f"pipeline_parallel_degree = {self.pp}",
        ]
        if self.pp > 1:
            lines += [f'pipeline_parallel_schedule = "{self.schedule}"',
                      f"pipeline_parallel_microbatch_size = {self.microbatch_size}"]
            if self.layers_per_stage is not None:
                lines.append(f"pipeline_parallel_layers_per_stage = {self.layers_per_stage}")
        return "\n".join(lines + ["", "[activation_checkpoint]", ac])

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                         ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)) if v > 1]
        s = " x ".join(parts) or "1 rank"
        s += f", AC {'selective op' if self.ac == 'op' else self.ac}"
        if self.pp > 1:
            s += f", {self.schedule} {self.local_batch_size // self.microbatch_size} microbatches of {self.microbatch_size}"
            if self.layers_per_stage is not None:
                s += f", {self.layers_per_stage} layers per stage"
        else:
            s += f", local batch {self.local_batch_size}" + (f" x {self.grad_accum} accumulation" if self.grad_accum > 1 else "")
        return s


@dataclasses.dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    time: StepTime
    tokens_per_s_per_device: float
    mfu: float


@dataclasses.dataclass
class PlanResult:
    ranked: list[Candidate]
    dropped: dict[str, int]
    """Why candidates were dropped: reason -> count."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _module_params(shape: ModelShape) -> dict[str, int]:
    d = {"tok_embeddings": shape.vocab * shape.dim, "norm": shape.dim, "output": shape.vocab * shape.dim}
    d.update({f"layers.{i}": shape.block_params for i in range(shape.n_layers)})
    return d


def _order(shape: ModelShape) -> list[str]:
    return ["tok_embeddings", *(f"layers.{i}" for i in range(shape.n_layers)), "norm", "output"]


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (blocks and output) + attention scores and values."""
    head_dim = shape.dim // shape.n_heads
    return 6 * (shape.n_layers * shape.block_params + shape.vocab * shape.dim) + 12 * shape.n_layers * shape.n_heads * head_dim * seq_len


def _ac_factor(ac: str) -> float:
    return {"none": 1.0, "op": 1.0, "full": 4 / 3}[ac]


def evaluate(shape: ModelShape, layout: Layout, device: Device, devices: int, seq_len: int,
             global_batch_size: int, mfu: float = DEFAULT_MFU, network: Network = FLAT_NETWORK) -> Candidate:
    """Memory and step time of one layout; raises LayoutError when the layout cannot run."""
    L = layout
    pd = ParallelDims(L.dp_replicate, L.dp_shard, L.cp, L.tp, L.pp, devices)
    pd.check_model({"tp": {"n_heads": shape.n_heads, "n_kv_heads": shape.kv_dim // (shape.dim // shape.n_heads),
                           "dim": shape.dim, "vocab_size": shape.vocab}})
    pd.check_batch(seq_len=seq_len, global_batch_size=global_batch_size, local_batch_size=L.local_batch_size)
    params = _module_params(shape)
    fsdp = L.dp_shard * L.cp
    if L.pp > 1:
        plan = plan_pipeline(
            Parallelism(pipeline_parallel_degree=L.pp, pipeline_parallel_schedule=L.schedule,
                        pipeline_parallel_microbatch_size=L.microbatch_size,
                        pipeline_parallel_layers_per_stage=L.layers_per_stage),
            _order(shape), 1, 2, L.local_batch_size)
        per_rank_stages = {r: [plan.stages[s] for s in plan.local_stages(r)] for r in (0, L.pp - 1)}
        n_mb = plan.n_microbatches
    else:
        per_rank_stages = {0: [tuple(_order(shape))]}
        n_mb = L.grad_accum
    # Memory of the heaviest pipeline rank (the first keeps the most microbatches, the last the output).
    worst: MemoryEstimate | None = None
    stage_params_max = 0
    for r, stages in per_rank_stages.items():
        names = [n for s in stages for n in s]
        stage_params = sum(params[n] for n in names)
        stage_params_max = max(stage_params_max, stage_params)
        local = stage_params / (L.tp * fsdp)
        state = StateBytes(params=int(4 * local), grads=int(4 * local), optimizer=int(8 * local))
        work = RankWork(
            tokens_per_microbatch=(L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len,
            blocks=sum(n.startswith("layers.") for n in names),
            holds_embedding="tok_embeddings" in names, holds_output="output" in names,
            in_flight=in_flight_microbatches(L.schedule, n_mb, L.pp, r, len(stages)) if L.pp > 1 else 1,
            grads_live=n_mb > 1, tp=L.tp, cp=L.cp, fsdp=fsdp, ac=L.ac, act_bytes=ACT_BYTES,
            gathered_param_bytes=ACT_BYTES, on_gpu=True,
        )
        est = estimate_memory(shape, state, work)
        if worst is None or est.peak > worst.peak:
            worst = est
    if worst.peak > device.memory_bytes:
        raise MemoryError(f"{worst.peak / 2**30:.1f} GiB > {device.memory_bytes / 2**30:.0f} GiB")

    # ---- step time ---------------------------------------------------------------------------------------
    per_replica_tokens = global_batch_size // pd.dp * seq_len
    fpt = flops_per_token(shape, seq_len)
    rank_tokens = (L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len / L.cp
    speed = mfu * min(1.0, rank_tokens / FULL_SPEED_TOKENS)
    compute = per_replica_tokens * fpt * _ac_factor(L.ac) / (L.tp * L.cp * L.pp) / (device.bf16_flops * speed)
    blocks_per_rank = math.ceil(shape.n_layers / L.pp)
    exposed: dict[str, float] = {}
    hidden = 0.0
    if fsdp > 1:
        span = L.tp * fsdp
        block = shape.block_params / L.tp
        ag, rs = (collective_time(device, fsdp, block * b, span, network) for b in (2, 4))
        gathers = 1 if L.pp > 1 else 2 * n_mb  # PP keeps a stage gathered for the whole schedule step
        units = blocks_per_rank + 1  # + the embedding / output group, about a block's size each
        hidden += units * (gathers * ag + rs)
    if L.dp_replicate > 1:
        shard = stage_params_max / (L.tp * fsdp) * 4
        hidden += 2 * collective_time(device, L.dp_replicate, shard, L.dp_replicate * fsdp * L.tp, network)
    if hidden:
        per_block = hidden / (blocks_per_rank + 1)
        exposed["FSDP/HSDP"] = max(0.0, hidden - compute) + per_block
    tokens_mb = (L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len / L.cp
    passes = n_mb if L.pp > 1 else L.grad_accum
    if L.tp > 1:
        per = collective_time(device, L.tp, tokens_mb * shape.dim * ACT_BYTES, L.tp, network)
        count = 8 + (4 if L.ac == "full" else 0)
        exposed["TP"] = blocks_per_rank * passes * count * per
    if L.cp > 1:
        kv = tokens_mb * L.cp * 2 * shape.kv_dim * ACT_BYTES  # K and V of the whole sequence
        per = collective_time(device, L.cp, kv, L.cp * L.tp, network)
        exposed["CP"] = blocks_per_rank * passes * 3 * per
    bubble = 0.0
    if L.pp > 1:
        v = plan.stages_per_rank
        bubble = (L.pp - 1) / (v * n_mb)
        act = tokens_mb * shape.dim * ACT_BYTES / L.tp  # sequence-parallel activations under TP
        exposed["PP send/recv"] = 2 * v * n_mb * collective_time(device, 2, 2 * act, 2 * devices // L.pp, network)
    t = StepTime(compute, exposed, bubble)
    tps = global_batch_size * seq_len / t.total / devices
    return Candidate(layout, worst, t, tps, tps * fpt / device.bf16_flops)


CP_MIN_SEQ_LEN = 32768
"""Context parallel is only considered from this sequence length: below it the model does not capture
what CP costs (attention in 2 x cp small chunks, load-balancing reorders), and practice (Llama 3: CP only
for the 128K stage) does not use it."""


def enumerate_layouts(shape: ModelShape, devices: int, seq_len: int, global_batch_size: int, gpus_per_node: int,
                      cp_min_seq_len: int = CP_MIN_SEQ_LEN):
    """Every layout of `devices` ranks worth judging: tp within a node, powers of two for cp and pp,
    FSDP or HSDP over what is left, each AC mode, each batch split."""
    cps = (1, 2, 4, 8, 16, 32) if seq_len >= cp_min_seq_len else (1,)
    for tp in (t for t in _divisors(gpus_per_node) if devices % t == 0):
        for cp in (c for c in cps if devices % (tp * c) == 0):
            for pp in (p for p in (1, 2, 4, 8, 16, 32, 64) if devices % (tp * cp * p) == 0 and p <= shape.n_layers):
                dp = devices // (tp * cp * pp)
                if global_batch_size % dp:
                    continue
                per_replica = global_batch_size // dp
                for dp_shard in _divisors(dp):
                    dp_replicate = dp // dp_shard
                    if dp_replicate > 1 and dp_shard * cp * tp < gpus_per_node:
                        continue  # HSDP replicates across nodes; a shard group smaller than a node is not worth it
                    for ac in AC_MODES:
                        if pp == 1:
                            for lbs in _divisors(per_replica):
                                yield Layout(dp_replicate, dp_shard, cp, tp, pp, ac, lbs, 1, "", per_replica // lbs)
                        else:
                            for schedule in SCHEDULES:
                                # Interleaved: 2 stages per rank by default, or more (smaller bubble, more sends).
                                per_stage = [None] + ([u for u in (1, 2, 4) if (shape.n_layers + 2) % (u * pp) == 0
                                                       and (shape.n_layers + 2) // (u * pp) > 2]
                                                      if schedule != "1F1B" else [])
                                for lps in per_stage:
                                    for mbs in _divisors(per_replica):
                                        yield Layout(dp_replicate, dp_shard, cp, tp, pp, ac, per_replica, mbs, schedule,
                                                     layers_per_stage=lps)


def plan_layouts(shape: ModelShape, device: Device, devices: int, seq_len: int, global_batch_size: int,
                 mfu: float = DEFAULT_MFU, cp_min_seq_len: int = CP_MIN_SEQ_LEN,
                 network: Network = FLAT_NETWORK) -> PlanResult:
    ranked, dropped = [], {"does not divide / invalid pipeline": 0, "does not fit memory": 0}
    for layout in enumerate_layouts(shape, devices, seq_len, global_batch_size, device.gpus_per_node, cp_min_seq_len):
        try:
            ranked.append(evaluate(shape, layout, device, devices, seq_len, global_batch_size, mfu, network))
        except LayoutError:
            dropped["does not divide / invalid pipeline"] += 1
        except MemoryError:
            dropped["does not fit memory"] += 1
    # Fastest first; among equals the simpler layout (fewer parallel dimensions, less recompute).
    # (Times equal to 3 significant digits are a tie: the model cannot tell them apart.)
    ranked.sort(key=lambda c: (float(f"{c.time.total:.3g}"), _complexity(c.layout)))
    return PlanResult(ranked, dropped)


def _complexity(L: Layout) -> tuple:
    return (sum(x > 1 for x in (L.dp_replicate, L.cp, L.tp, L.pp)), AC_MODES.index(L.ac), -L.local_batch_size)


def explain(c: Candidate, seq_len: int, global_batch_size: int, device: Device) -> str:
    t = c.time
    parts = [f"compute {t.compute:.2f} s"]
    parts += [f"{k} exposed {v:.2f} s" for k, v in t.exposed.items()]
    if t.bubble:
        parts.append(f"pipeline bubble {100 * t.bubble:.0f}%")
    return (f"{c.layout.describe()}\n"
            f"  predicted {c.tokens_per_s_per_device:,.0f} tokens/s/device (MFU {100 * c.mfu:.0f}%), step "
            f"{t.total:.2f} s = {', '.join(parts)}\n"
            f"  peak memory {c.memory.peak / 2**30:.1f} GiB of {device.memory_bytes / 2**30:.0f} GiB "
            f"(activations {c.memory.components['activations'] / 2**30:.1f}, model states "
            f"{sum(c.memory.components[k] for k in ('parameters', 'gradients', 'optimizer state')) / 2**30:.1f})")


@dataclasses.dataclass(frozen=True)
class Published:
    """A layout someone trained with, and the throughput they reported (tokens/s/GPU; 0 = not published)."""

    name: str
    flavor: str
    devices: int
    seq_len: int
    global_batch_size: int
    tp: int
    pp: int
    cp: int
    tokens_per_s: float
    """Reported tokens/s/GPU, or FLOP/s/GPU converted with this model's flops_per_token (see below)."""
    source: str
    network: Network = FLAT_NETWORK

    def describe(self) -> str:
        dp = self.devices // (self.tp * self.pp * self.cp)
        return " x ".join(f"{n} {v}" for n, v in (("pp", self.pp), ("dp", dp), ("cp", self.cp), ("tp", self.tp)) if v > 1)


def matches(layout: Layout, p: Published) -> bool:
    """The published degrees (FSDP or HSDP for the data-parallel part, any AC and batch split)."""
    return (layout.tp, layout.pp, layout.cp) == (p.tp, p.pp, p.cp)


PUBLISHED = (
    Published("Llama 3.1 8B, 8 H100", "8B", 8, 8192, 16, 1, 1, 1, 5762,
              "torchtitan paper (arXiv 2410.06511), 1D FSDP, bf16, no compile"),
    Published("Llama 3.1 70B, 256 H100", "70B", 256, 8192, 256, 8, 1, 1, 829,
              "torchtitan paper, 2D FSDP x TP 8"),
    Published("Llama 3.1 405B, 512 H100", "405B", 512, 8192, 256, 8, 8, 1, 100,
              "torchtitan paper, 3D FSDP 8 x TP 8 x PP 8, 1F1B"),
    Published("Llama 3 405B, 16K H100", "405B", 16384, 8192, 2048, 8, 16, 1,
              400e12 / flops_per_token(ModelShape(16384, 53248, 1024, 128, 128256, 126), 8192),
              "Llama 3 paper (arXiv 2407.21783) Table 4: 400 TFLOP/s/GPU (38% MFU) at TP 8, PP 16, DP 128, 8K "
              "sequences, 16M tokens per batch; converted to tokens/s with flops_per_token", LLAMA3_RDMA_CLUSTER),
)
"""Published layouts the planner is checked against (tests/unit/test_planner.py, docs/planning.md)."""
