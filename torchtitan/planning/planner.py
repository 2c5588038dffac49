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
from torchtitan.planning.hardware import FLAT_NETWORK, Device, Network
from torchtitan.planning.memory import (
    MemoryEstimate,
    ModelShape,
    RankWork,
    StateBytes,
    estimate_memory,
    in_flight_microbatches,
    pp_recv_buffer_count,
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


def module_flops_per_token(shape: ModelShape, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token of each top-level module: 6 per matmul weight, + attention scores and values
    for a block; the embedding (a lookup) and the norm about zero."""
    block = 6 * shape.block_params + 12 * (shape.q_dim or shape.dim) * seq_len  # attention: n_heads x head_dim
    d = {"tok_embeddings": 0.0, "norm": 0.0, "output": 6.0 * shape.vocab * shape.dim}
    d.update({f"layers.{i}": float(block) for i in range(shape.n_layers)})
    return d


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token of the whole model (what MFU and published TFLOP/s figures count)."""
    return sum(module_flops_per_token(shape, seq_len).values())


def _ac_factor(ac: str) -> float:
    return {"none": 1.0, "op": 1.0, "full": 4 / 3}[ac]


def evaluate(shape: ModelShape, layout: Layout, device: Device, devices: int, seq_len: int,
             global_batch_size: int, mfu: float = DEFAULT_MFU, network: Network = FLAT_NETWORK) -> Candidate:
    """Memory and step time of one layout; raises LayoutError when the layout cannot run."""
    L = layout
    pd = ParallelDims(L.dp_replicate, L.dp_shard, L.cp, L.tp, L.pp, devices)
    head_dim = (shape.q_dim or shape.dim) // shape.n_heads
    pd.check_model({"tp": {"n_heads": shape.n_heads, "n_kv_heads": shape.kv_dim // head_dim,
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
        all_ranks = {r: [plan.stages[s] for s in plan.local_stages(r)] for r in range(L.pp)}
        # Memory is judged on the first rank (most microbatches in flight), the last (the output and loss)
        # and the one with the most block activations in flight (rank 1 when rank 0's first stage is only
        # the embedding).
        def in_flight_blocks(r: int) -> float:
            blocks = sum(n.startswith("layers.") for st in all_ranks[r] for n in st)
            return blocks * in_flight_microbatches(L.schedule, plan.n_microbatches, L.pp, r, len(all_ranks[r]))

        heaviest = max(range(L.pp), key=in_flight_blocks)
        per_rank_stages = {r: all_ranks[r] for r in (0, heaviest, L.pp - 1)}
        n_mb = plan.n_microbatches
    else:
        all_ranks = per_rank_stages = {0: [tuple(_order(shape))]}
        n_mb = L.grad_accum
    # The pipeline runs at the pace of its busiest rank (stages differ: the output projection weighs
    # more than a block, the embedding nothing).
    module_fpt = module_flops_per_token(shape, seq_len)
    busiest_fpt = max(sum(module_fpt[n] for st in stages for n in st) for stages in all_ranks.values())
    # Memory of the heaviest pipeline rank.
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
            unsharded_grad_params=int(stage_params / L.tp) if fsdp > 1 and n_mb > 1 else 0,
            params_stay_gathered=L.pp > 1,
            pp_recv_buffers=pp_recv_buffer_count(n_mb, len(stages), "tok_embeddings" in names, "output" in names)
            if L.pp > 1 else 0,
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
    compute = per_replica_tokens * busiest_fpt * _ac_factor(L.ac) / (L.tp * L.cp) / (device.bf16_flops * speed)
    blocks_per_rank = math.ceil(shape.n_layers / L.pp)
    exposed: dict[str, float] = {}
    # FSDP / HSDP. Gradients are reduced once, after the last microbatch (the trainer turns gradient sync off
    # for the others; under PP torch's PipelineStage does), so the reduce-scatter (and HSDP's all-reduce)
    # hides only behind that microbatch's backward; under PP only the rank's last stage's reduction is
    # exposed that way (the other stages' run while it still computes). Gathers: without PP every block is
    # gathered per microbatch in forward and again in backward, prefetched behind the step's compute; under
    # PP a stage stays gathered, so its gathers hide only behind the first microbatch's forward. The first
    # gather and the last reduction of a block are never hidden.
    if fsdp > 1 or L.dp_replicate > 1:
        span = L.tp * fsdp
        units = blocks_per_rank + 1  # + the embedding / output group, about a block's size each
        block = shape.block_params / L.tp
        ag, rs = (collective_time(device, fsdp, block * b, span, network) for b in (2, 4))
        ar = 0.0
        if L.dp_replicate > 1:
            shard = stage_params_max / (L.tp * fsdp) * 4
            ar = 2 * collective_time(device, L.dp_replicate, shard, L.dp_replicate * fsdp * L.tp, network)
        mb_compute = compute / n_mb  # one microbatch through all of this rank's stages
        fwd = mb_compute / (3 * _ac_factor(L.ac))
        v = plan.stages_per_rank if L.pp > 1 else 1
        gather = units * ag - fwd if L.pp > 1 else 2 * n_mb * units * ag - compute
        reduce = (units * rs + ar - (mb_compute - fwd)) / v
        exposed["FSDP/HSDP"] = max(0.0, gather) + max(0.0, reduce) + ag + rs
    tokens_mb = (L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len / L.cp
    passes = n_mb if L.pp > 1 else L.grad_accum
    if L.tp > 1:
        per = collective_time(device, L.tp, tokens_mb * shape.dim * ACT_BYTES, L.tp, network)
        # 2 all-gathers + 2 reduce-scatters in forward, as many in backward; recomputation repeats the
        # forward's 4 under full AC and, under op AC, the 2 all-gathers (only reduce-scatter outputs are saved).
        count = 8 + {"none": 0, "op": 2, "full": 4}[L.ac]
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
    """Every layout enumerate_layouts yields, judged and ranked."""
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
