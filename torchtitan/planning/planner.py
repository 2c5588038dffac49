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
from torchtitan.distributed.pipeline import SPLIT_BACKWARD, plan_pipeline
from torchtitan.planning.cp_comm import cp_block_time, cp_options
from torchtitan.planning.hardware import FLAT_NETWORK, Device, Network, headroom_note, memory_limit
from torchtitan.planning.memory import (
    MemoryEstimate,
    ModelShape,
    RankWork,
    StateBytes,
    estimate_memory,
    in_flight_microbatches,
    output_in_flight,
    pp_moments,
    pp_recv_buffer_count,
    sends_held,
    split_backward_pending_weight,
)
from torchtitan.planning.memory_budget import (
    OFFLOAD_BANDWIDTH_CUDA,
    BlockPlan,
    activation_room,
    block_costs,
    offloaded_bytes,
    plan_memory,
    solve,
)
from torchtitan.planning.schedule_order import bubble_fraction
from torchtitan.planning.step_time import DEFAULT_MFU
from torchtitan.planning.step_time import (
    ASYNC_TP_HIDDEN,
    NCCL_SM_SHARE,
    BlockShape,
    StepTime,
    ac_recompute,
    block_seconds,
    collective_time,
    link,
    optimizer_seconds,
    output_seconds,
)

AC_MODES = ("none", "op", "full")
BUDGET_AC = "budget"
"""The AC "mode" of a layout judged under --memory-budget-gib: keep, op, full, offload or full_offload chosen per
block by the memory-budget planner (planning/memory_budget.py), the fastest mix whose peak stays within the budget."""
BUDGET_MAX_UNITS = 4096
"""Memory axis of the per-block search inside the layout planner (it runs once per layout; bytes are rounded
up to 1/4096 of the room, so a plan stays within the budget and may miss one at its very edge)."""
MODEL_PARALLEL = ("tp", "pp", "cp")
SCHEDULES = ("1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
"""The schedules the planner weighs. GPipe and LoopedBFS have 1F1B's and Interleaved1F1B's bubbles with all
microbatches in flight (never better); DualPipeV overlaps the all-to-all of expert parallelism, which the
planner's dense models do not have."""
STATE_BYTES_PER_PARAM = 16
"""fp32 parameter + fp32 gradient + AdamW's two fp32 moments (training.dtype float32, bf16 compute)."""
ACT_BYTES = 2
"""bf16 activations and gathered parameters (mixed_precision_param bfloat16)."""


def model_parallel_dims(degrees) -> frozenset[str]:
    """The model-parallel dimensions (MODEL_PARALLEL) that an object with tp, pp, cp degrees uses (> 1)."""
    return frozenset(n for n in MODEL_PARALLEL if getattr(degrees, n) > 1)


@dataclasses.dataclass(frozen=True)
class Features:
    """Training features the user has chosen (the planner does not choose them); they change what each
    layout costs: Float8 speeds up compute but not communication, async TP hides TP traffic."""

    float8: bool = False
    """Tensorwise Float8 linears (--model.converters float8; the output projection stays bf16)."""
    float8_all_gather: bool = False
    """FSDP all-gathers the Float8 linears' weights in float8 (--float8.enable_fsdp_float8_all_gather)."""
    async_tp: bool = False
    """--parallelism.enable_async_tensor_parallel (with --compile.enable)."""
    compile: bool = False
    """--compile.enable (model and loss). Float8 and async TP imply it (the recipe turns it on for them)."""
    eager_loss: bool = False
    """The loss stays eager under compile: torchtitan's train.py of late 2024 (the Dec 2024 benchmarks) had its
    loss compile commented out ("compiling loss function causes CUDA errors"); its 2025 `build_cross_entropy_loss`
    and this repository compile it. Only published runs set it."""

    @property
    def compiled(self) -> bool:
        """Whether the model runs compiled: asked for, or implied by Float8 (async TP implies it only with TP,
        and evaluate adds it there)."""
        return self.compile or self.float8

    @property
    def loss_compiled(self) -> bool:
        """Whether the loss runs compiled: fused into one pass over the logits that keeps no fp32 copy."""
        return self.compiled and not self.eager_loss

    def __post_init__(self):
        if self.float8_all_gather and not self.float8:
            raise ValueError("float8 all-gather needs Float8 linears: add --float8 (the planner's flag)")

    def toml(self, tp: int) -> str:
        """Recipe lines for these features; async TP only where there is TP. Compile comes with both: async
        TP is done by the compiler, and Float8's casts are priced fused (step_time.FLOAT8_CAST_BYTES)."""
        sections = []
        if self.float8:
            sections.append('[model]\nconverters = ["float8"]')
            if self.float8_all_gather:
                sections.append("[float8]\nenable_fsdp_float8_all_gather = true\n"
                                "precompute_float8_dynamic_scale_for_fsdp = true")
        if self.compiled or (self.async_tp and tp > 1):
            sections.append('[compile]\nenable = true\ncomponents = ["model", "loss"]')
        return "\n\n".join(sections)


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
    cp_method: str = "ring"
    """parallelism.context_parallel_method; `evaluate` picks the fastest that can run (planning/cp_comm.py)."""
    cp_a2a_degree: int = 0
    """parallelism.context_parallel_a2a_degree (hierarchical CP)."""
    budget_gib: float = 0.0
    """ac == "budget": the per-rank budget (--memory.budget_gib) the recipe passes on."""
    block_plan: tuple[str, ...] = ()
    """ac == "budget": the choice per block of the first pipeline rank, as `evaluate` predicts it (the
    trainer's own planner makes the plan again from the same formulas before its ranks start)."""

    def toml(self, seq_len: int, global_batch_size: int, features: Features = Features()) -> str:
        ac = {"none": 'mode = "none"', "full": 'mode = "full"', BUDGET_AC: 'mode = "none"',
              "op": 'mode = "selective"\nselective_ac_option = "op"'}[self.ac]
        if self.ac == BUDGET_AC:  # the trainer plans the blocks for this budget again, before its ranks start
            ac += f"\n\n[memory]\nbudget_gib = {self.budget_gib:g}"
        lines = [
            "[training]", f"seq_len = {seq_len}", f"local_batch_size = {self.local_batch_size}",
            f"global_batch_size = {global_batch_size}", "mixed_precision_param = \"bfloat16\"", "",
            "[parallelism]", f"data_parallel_replicate_degree = {self.dp_replicate}",
            f"data_parallel_shard_degree = {self.dp_shard}", f"tensor_parallel_degree = {self.tp}",
            f"context_parallel_degree = {self.cp}", f"pipeline_parallel_degree = {self.pp}",
        ]
        if self.cp > 1 and self.cp_method != "ring":
            lines.append(f'context_parallel_method = "{self.cp_method}"')
            if self.cp_method == "hierarchical":
                lines.append(f"context_parallel_a2a_degree = {self.cp_a2a_degree}")
        if self.pp > 1:
            lines += [f'pipeline_parallel_schedule = "{self.schedule}"',
                      f"pipeline_parallel_microbatch_size = {self.microbatch_size}"]
            if self.layers_per_stage is not None:
                lines.append(f"pipeline_parallel_layers_per_stage = {self.layers_per_stage}")
        if features.async_tp and self.tp > 1:
            lines.append("enable_async_tensor_parallel = true")
        extra = features.toml(self.tp)
        return "\n".join(lines + ["", "[activation_checkpoint]", ac] + (["", extra] if extra else []))

    @property
    def model_parallel(self) -> frozenset[str]:
        return model_parallel_dims(self)

    def describe(self) -> str:
        parts = [f"{n} {v}" for n, v in (("pp", self.pp), ("dp_replicate", self.dp_replicate),
                                         ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)) if v > 1]
        s = " x ".join(parts) or "1 rank"
        if self.cp > 1 and self.cp_method != "ring":
            s += f" (cp {self.cp_method}" + (f", a2a {self.cp_a2a_degree})" if self.cp_a2a_degree else ")")
        if self.ac == BUDGET_AC:
            s += f", per block for the {self.budget_gib:g} GiB budget: {block_runs(self.block_plan)}"
        else:
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
    host_bytes: int = 0
    """Host memory per GPU a budget's plan fills (pinned offloaded activations of its busiest rank)."""


class HostMemoryError(MemoryError):
    """A layout's plan puts more in a node's host memory than --host-gib allows."""


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


def module_seconds_per_microbatch(shape: ModelShape, device: Device, seq_len: int, tokens: float, tp: int, cp: int,
                                  ac: str, features: Features) -> dict[str, float]:
    """Seconds one rank spends on each top-level module for a microbatch of `tokens` tokens of its TP x CP group
    (step_time.block_seconds, output_seconds); the embedding and the final norm about zero."""
    b = BlockShape(shape.dim, shape.q_dim or shape.dim, shape.kv_dim, shape.hidden)
    block = sum(block_seconds(device, b, tokens, seq_len, tp, cp, ac, features.compiled, features.float8,
                              features.float8_all_gather).values())
    d = {"tok_embeddings": 0.0, "norm": 0.0,
         "output": output_seconds(device, shape.dim, shape.vocab, tokens, tp, cp, features.loss_compiled)}
    d.update({f"layers.{i}": block for i in range(shape.n_layers)})
    return d


def flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token of the whole model (what MFU and published TFLOP/s figures count)."""
    return sum(module_flops_per_token(shape, seq_len).values())


def _ac_factor(ac: str) -> float:
    """Matmul work of a step relative to no AC (a budget's per-block plan adds its own seconds: _budget_plan)."""
    return 1.0 if ac == BUDGET_AC else 1 + ac_recompute(ac) / 3



def block_runs(choices: tuple[str, ...]) -> str:
    """("full", "full", "op") -> "0-1 full, 2 op"."""
    runs: list[list] = []
    for i, c in enumerate(choices):
        if runs and runs[-1][2] == c:
            runs[-1][1] = i
        else:
            runs.append([i, i, c])
    return ", ".join(f"{a}-{b} {c}" if a != b else f"{a} {c}" for a, b, c in runs)


def _budget_plan(shape: ModelShape, state: StateBytes, work: RankWork, limit: float, seq_len: int,
                 microbatches: int, flops: float, bandwidth: float) -> tuple[MemoryEstimate, BlockPlan, int]:
    """The fastest per-block plan of keep/op/full/offload/full_offload whose estimated peak is within `limit`
    (the memory budget planner's own formulas and search, planning/memory_budget.py), and the host bytes its
    offloaded blocks fill; MemoryError when none is."""
    room = activation_room(shape, state, work, int(limit))
    best: BlockPlan | None = None
    for prefetch in (True, False):
        costs, _, _ = block_costs(shape, work, seq_len, microbatches, flops, bandwidth, prefetch)
        found = solve(costs, room, max_units=BUDGET_MAX_UNITS)
        if found is not None and (best is None or (found.seconds, found.activation_bytes)
                                  < (best.seconds, best.activation_bytes)):
            best, host = found, offloaded_bytes(costs, found.choices)
    if best is None:
        raise MemoryError(f"no per-block plan within {limit / 2**30:.1f} GiB")
    return plan_memory(shape, state, work, best), best, host


def evaluate(shape: ModelShape, layout: Layout, device: Device, devices: int, seq_len: int,
             global_batch_size: int, mfu: float | None = None, network: Network = FLAT_NETWORK,
             features: Features = Features(), memory_headroom: float = 0.0, budget_bytes: float = 0.0,
             offload_bandwidth: float = OFFLOAD_BANDWIDTH_CUDA * 1e9, host_bytes: float = 0.0,
             cp_method: tuple[str, int] | None = None, cp_kv_heads: int | None = None,
             pp_outputs_kept: bool = False) -> Candidate:
    """Memory and step time of one layout; raises LayoutError when the layout cannot run and MemoryError
    when its estimated peak exceeds the device's memory less `memory_headroom` (a fraction kept free), or
    `budget_bytes` (--memory-budget-gib) when that is lower. Layout.ac == "budget": the blocks' choices are
    the memory-budget planner's for this rank (offload priced at `offload_bandwidth` bytes/s); with
    `host_bytes` (a node's RAM, --host-gib; 0 = unchecked), HostMemoryError when the pinned host memory its
    offloaded blocks fill, x the device's GPUs per node, exceeds it. `mfu`: the fraction of the bf16 peak large
    matmuls reach, instead of the device's (Device.gemm_eff). `cp_method` ((method, a2a degree)): the CP method
    a run used, instead of the fastest that can run (a published run is priced as it ran); `cp_kv_heads`: the
    k/v heads the attention receives, instead of the model's (torchtitan before 2025 repeated k/v to the query
    heads before SDPA, so its ring CP moved n_heads of them); `pp_outputs_kept`: the last pipeline stage keeps every
    microbatch's output for the schedule's return value (torch before 2025; RankWork.pp_kept_outputs)."""
    L = layout
    if mfu is not None:
        device = dataclasses.replace(device, gemm_eff=mfu)
    ac = "none" if L.ac == BUDGET_AC else L.ac  # a budget's plan sets the blocks' bytes itself (_budget_plan)
    if features.async_tp and L.tp > 1:  # async TP is done by the compiler: the recipe turns compile on
        features = dataclasses.replace(features, compile=True)
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
        pending = split_backward_pending_weight(shape, ac, L.tp)

        def in_flight_blocks(r: int) -> float:
            blocks = sum(n.startswith("layers.") for st in all_ranks[r] for n in st)
            return blocks * in_flight_microbatches(L.schedule, plan.n_microbatches, L.pp, r, len(all_ranks[r]),
                                                   pending)

        heaviest = max(range(L.pp), key=in_flight_blocks)
        per_rank_stages = {r: all_ranks[r] for r in (0, heaviest, L.pp - 1)}
        n_mb = plan.n_microbatches
    else:
        all_ranks = per_rank_stages = {0: [tuple(_order(shape))]}
        n_mb = L.grad_accum
    # The pipeline runs at the pace of its busiest rank (stages differ: the output projection weighs
    # more than a block, the embedding nothing).
    mb_tokens = (L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len  # the TP x CP group's
    module_s = module_seconds_per_microbatch(shape, device, seq_len, mb_tokens, L.tp, L.cp, ac, features)
    busiest_s = max(sum(module_s[n] for st in stages for n in st) for stages in all_ranks.values())
    speed = DEFAULT_MFU  # the memory-budget planner prices its recomputation at this fraction of the peak
    limit = memory_limit(device, memory_headroom)
    if budget_bytes:
        limit = min(limit, budget_bytes)
    # Memory of the heaviest pipeline rank.
    worst: MemoryEstimate | None = None
    rank_plans: dict[int, BlockPlan] = {}
    rank_host: dict[int, int] = {}
    stage_params_max = 0
    for r, stages in per_rank_stages.items():
        names = [n for s in stages for n in s]
        stage_params = sum(params[n] for n in names)
        stage_params_max = max(stage_params_max, stage_params)
        local = stage_params / (L.tp * fsdp)
        state = StateBytes(params=int(4 * local), grads=int(4 * local), optimizer=int(8 * local))
        moments = pp_moments(L.schedule, n_mb, L.pp, r, len(stages), pending,
                             tuple(sum(params[n] for n in st) / stage_params for st in stages)
                             ) if L.pp > 1 and n_mb > 1 else ()
        work = RankWork(
            tokens_per_microbatch=(L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len,
            blocks=sum(n.startswith("layers.") for n in names),
            holds_embedding="tok_embeddings" in names, holds_output="output" in names,
            in_flight=in_flight_microbatches(L.schedule, n_mb, L.pp, r, len(stages), pending) if L.pp > 1 else 1,
            grads_live=n_mb > 1,
            pp_moments=moments, out_in_flight=output_in_flight(moments, len(stages)) if L.pp > 1 else None,
            pp_sends_held=sends_held(moments), tp=L.tp, cp=L.cp, fsdp=fsdp, ac=ac, act_bytes=ACT_BYTES,
            gathered_param_bytes=1 if features.float8_all_gather else ACT_BYTES, on_gpu=True,
            unsharded_grad_params=int(stage_params / L.tp) if fsdp > 1 and n_mb > 1 else 0,
            params_stay_gathered=L.pp > 1,
            pp_recv_buffers=pp_recv_buffer_count(n_mb, len(stages), "tok_embeddings" in names, "output" in names)
            if L.pp > 1 else 0,
            loss_compiled=features.loss_compiled, loss_parallel=L.tp > 1,
            pp_kept_outputs=n_mb if L.pp > 1 and pp_outputs_kept and "output" in names else 0,
        )
        est = estimate_memory(shape, state, work)
        if L.ac == BUDGET_AC:
            est, rank_plans[r], rank_host[r] = _budget_plan(shape, state, work, limit, seq_len, n_mb,
                                                            device.bf16_flops * speed, offload_bandwidth)
        if worst is None or est.peak > worst.peak:
            worst = est
    if worst.peak > limit:
        raise MemoryError(f"{worst.peak / 2**30:.1f} GiB > {limit / 2**30:.0f} GiB{headroom_note(memory_headroom)}")
    host = max(rank_host.values(), default=0)  # every GPU of a node may be the busiest rank's kind
    if host_bytes and host * min(device.gpus_per_node, devices) > host_bytes:
        raise HostMemoryError(f"{host * min(device.gpus_per_node, devices) / 2**30:.0f} GiB of host memory per node")
    added = 0.0  # seconds a budget's per-block plan adds: the pipeline runs at its slowest rank's pace
    if rank_plans:
        added = max(p.seconds for p in rank_plans.values())
        layout = L = dataclasses.replace(L, budget_gib=budget_bytes / 2**30, block_plan=rank_plans[0].choices)

    # ---- step time ---------------------------------------------------------------------------------------
    per_replica_tokens = global_batch_size // pd.dp * seq_len
    fpt = flops_per_token(shape, seq_len)
    compute = per_replica_tokens / mb_tokens * busiest_s
    compute += added  # recomputation and offload moves of a budget's plan
    compute += optimizer_seconds(device, stage_params_max / (L.tp * fsdp))
    blocks_per_rank = math.ceil(shape.n_layers / L.pp)
    exposed: dict[str, float] = {}
    # FSDP / HSDP. Gradients are reduced once, after the last microbatch (the trainer turns gradient sync off
    # for the others; under PP torch's PipelineStage does). Without PP every block is gathered per
    # microbatch in forward and again in backward, one block ahead (FSDP2's prefetch), so each phase's
    # gathers hide only behind that phase's compute; the last backward also carries the reduce-scatter (and
    # HSDP's all-reduce) on the same link, so they hide together or not at all. Under PP a stage stays
    # gathered: its gathers hide only behind the first microbatch's forward, and only the rank's last stage's
    # reduction is exposed behind its last backward (the other stages' run while it still computes). The
    # first gather and the last reduction of a block are never hidden.
    if fsdp > 1 or L.dp_replicate > 1:
        span = L.tp * fsdp
        units = blocks_per_rank + 1  # + the embedding / output group, about a block's size each
        block = shape.block_params / L.tp
        gathered = 1 if features.float8_all_gather else ACT_BYTES
        ag, rs = (collective_time(device, fsdp, block * b, span, network) for b in (gathered, 4))
        ar = 0.0
        if L.dp_replicate > 1:
            shard = stage_params_max / (L.tp * fsdp) * 4
            ar_span = L.dp_replicate * fsdp * L.tp
            ar = 2 * collective_time(device, L.dp_replicate, shard, ar_span, network)
        shared = L.dp_replicate == 1 or link(device, span) == link(device, L.dp_replicate * span)

        def with_all_reduce(fsdp_traffic: float) -> float:
            """Time of the FSDP group's traffic and HSDP's all-reduce: added on one link, overlapped on two."""
            return fsdp_traffic + ar if shared else max(fsdp_traffic, ar)

        mb_compute = compute / n_mb  # one microbatch through all of this rank's stages
        fwd = mb_compute / (3 * _ac_factor(L.ac))
        bwd = mb_compute - fwd
        gathers = units * ag
        if L.pp > 1:
            v = plan.stages_per_rank
            hidden_late = max(0.0, gathers - fwd) + max(0.0, with_all_reduce(units * rs) - bwd) / v
            traffic = gathers + with_all_reduce(units * rs)
        else:  # the last backward's gathers ride the reduce-scatter's link
            hidden_late = (n_mb * max(0.0, gathers - fwd) + (n_mb - 1) * max(0.0, gathers - bwd)
                           + max(0.0, with_all_reduce(gathers + units * rs) - bwd))
            traffic = (2 * n_mb - 1) * gathers + with_all_reduce(gathers + units * rs)
        exposed["FSDP/HSDP"] = hidden_late + ag + rs
        # The hidden part still takes NCCL's SMs and HBM bandwidth from the compute it overlaps.
        exposed["FSDP/HSDP beside compute"] = NCCL_SM_SHARE * max(0.0, traffic - exposed["FSDP/HSDP"])
    tokens_mb = (L.microbatch_size if L.pp > 1 else L.local_batch_size) * seq_len / L.cp
    passes = n_mb if L.pp > 1 else L.grad_accum
    if L.tp > 1:
        full = tokens_mb * shape.dim * ACT_BYTES
        per = collective_time(device, L.tp, full, L.tp, network)
        # 2 all-gathers + 2 reduce-scatters in forward, as many in backward; recomputation repeats the
        # forward's 4 under full AC and, under op AC, the 2 all-gathers (only reduce-scatter outputs are saved).
        # torchtitan's upstream op policy saves the reduce-scatter outputs too; every k-th block: 4 / k.
        repeats = {"none": 0, "op": 2, "op_half_matmuls": 2, "full": 4, "full_offload": 4}
        count = 8 + (sum(repeats.get(c, 0) for c in L.block_plan) / len(L.block_plan) if L.ac == BUDGET_AC
                     else repeats.get(L.ac, 4 * ac_recompute(L.ac)))
        comm = count * per
        if features.float8:  # the forward's all-gathers (and their recomputation) carry float8
            forward_gathers = 2 + (2 if L.ac in ("op", "op_half_matmuls", "full") else 0)
            comm -= forward_gathers * (per - collective_time(device, L.tp, full / ACT_BYTES, L.tp, network))
        if features.async_tp:
            b = BlockShape(shape.dim, shape.q_dim or shape.dim, shape.kv_dim, shape.hidden)
            linears = block_seconds(device, b, tokens_mb * L.cp, seq_len, L.tp, L.cp, ac, True, features.float8,
                                    features.float8_all_gather)["matmul"]
            comm -= min(ASYNC_TP_HIDDEN * comm, linears)
        exposed["TP"] = blocks_per_rank * passes * comm
    if L.cp > 1:
        # The CP method is the planner's pick for this network: the fastest that can run (planning/cp_comm.py).
        kv_heads = cp_kv_heads or shape.kv_dim // head_dim
        cp_times = {opt: cp_block_time(device, network, *opt, cp=L.cp, tp=L.tp, tokens=tokens_mb,
                                       n_heads=shape.n_heads, kv_heads=kv_heads,
                                       head_dim=head_dim, act_bytes=ACT_BYTES)
                    for opt in ([cp_method] if cp_method else
                                cp_options(L.cp, L.tp, shape.n_heads, device.gpus_per_node))}
        (method, a2a), per_block = min(cp_times.items(), key=lambda kv: kv[1])
        layout = dataclasses.replace(L, cp_method=method, cp_a2a_degree=a2a)
        exposed["CP"] = blocks_per_rank * passes * per_block
    bubble = 0.0
    if L.pp > 1:
        v = plan.stages_per_rank
        if v == 1 or L.schedule == "Interleaved1F1B":  # the closed forms (a test checks the second)
            bubble = (L.pp - 1) / (v * n_mb)
        else:  # torch's own order played with a stage's forward, input-gradient and weight-gradient times
            recompute = 1.0 if L.ac == "full" else 0.0
            bubble = bubble_fraction(L.schedule, n_mb, L.pp, v, 1.0, 1.0 + recompute, 1.0)
        act = tokens_mb * shape.dim * ACT_BYTES / L.tp  # sequence-parallel activations under TP
        exposed["PP send/recv"] = 2 * v * n_mb * collective_time(device, 2, 2 * act, 2 * devices // L.pp, network)
    t = StepTime(compute, exposed, bubble)
    tps = global_batch_size * seq_len / t.total / devices
    return Candidate(layout, worst, t, tps, tps * fpt / device.bf16_flops, host)


CP_MIN_SEQ_LEN = 32768
"""Context parallel is only considered from this sequence length: below it the model does not capture
what CP costs (attention in 2 x cp small chunks, load-balancing reorders), and practice (Llama 3: CP only
for the 128K stage) does not use it."""


def enumerate_layouts(shape: ModelShape, devices: int, seq_len: int, global_batch_size: int, gpus_per_node: int,
                      cp_min_seq_len: int = CP_MIN_SEQ_LEN, budget: bool = False):
    """Every layout of `devices` ranks worth judging: tp within a node, powers of two for cp and pp,
    FSDP or HSDP over what is left, each AC mode (and, with a memory budget, a per-block plan), each batch
    split."""
    ac_modes = (*AC_MODES, BUDGET_AC) if budget else AC_MODES
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
                    for ac in ac_modes:
                        if pp == 1:
                            for lbs in _divisors(per_replica):
                                yield Layout(dp_replicate, dp_shard, cp, tp, pp, ac, lbs, 1, "", per_replica // lbs)
                        else:
                            for schedule in SCHEDULES:
                                if schedule in SPLIT_BACKWARD and ac != "none":
                                    continue  # op AC cannot run with them; full AC re-runs each block per weight
                                # Looped: 2 stages per rank by default, or more (smaller bubble, more sends);
                                # V-shaped: 2.
                                looped = schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
                                per_stage = [None] + ([u for u in (1, 2, 4) if (shape.n_layers + 2) % (u * pp) == 0
                                                       and (shape.n_layers + 2) // (u * pp) > 2]
                                                      if looped else [])
                                for lps in per_stage:
                                    for mbs in _divisors(per_replica):
                                        yield Layout(dp_replicate, dp_shard, cp, tp, pp, ac, per_replica, mbs, schedule,
                                                     layers_per_stage=lps)


def parse_model_parallel(text: str | None) -> frozenset[str] | None:
    """--parallelisms: "tp,pp" -> {"tp", "pp"}; "none" -> data parallel only; None -> any layout."""
    if text is None:
        return None
    names = frozenset(n.strip() for n in text.split(",") if n.strip() and n.strip() != "none")
    _check_model_parallel(names)
    return names


def _check_model_parallel(names: frozenset[str]) -> None:
    unknown = sorted(names - set(MODEL_PARALLEL))
    if unknown:
        raise ValueError(f"--parallelisms: unknown {', '.join(unknown)}; choose from {','.join(MODEL_PARALLEL)} or "
                         f"none (data parallel takes the remaining devices)")


def plan_layouts(shape: ModelShape, device: Device, devices: int, seq_len: int, global_batch_size: int,
                 mfu: float | None = None, cp_min_seq_len: int = CP_MIN_SEQ_LEN,
                 network: Network = FLAT_NETWORK, features: Features = Features(),
                 model_parallel: frozenset[str] | None = None, memory_headroom: float = 0.0,
                 budget_bytes: float = 0.0, offload_bandwidth: float = OFFLOAD_BANDWIDTH_CUDA * 1e9,
                 host_bytes: float = 0.0) -> PlanResult:
    """Every layout enumerate_layouts yields, judged and ranked. `model_parallel` keeps only the layouts that
    use exactly these model-parallel dimensions (a subset of MODEL_PARALLEL; data parallel takes the rest);
    None keeps all. `memory_headroom`: the fraction of the device's memory a layout must leave free.
    `budget_bytes` (--memory-budget-gib, 0 = none): a per-rank peak every layout must stay within, and each
    layout is also judged with the memory-budget planner's per-block plan of keep/op/full/offload/full_offload.
    `host_bytes` (--host-gib, a node's RAM; 0 = unchecked): a layout whose plan's pinned host memory per node
    exceeds it is dropped."""
    if model_parallel is not None:
        _check_model_parallel(model_parallel)
    memory_limit(device, memory_headroom)  # a bad fraction fails here, not as "nothing fits"
    ranked, dropped = [], {"does not divide / invalid pipeline": 0, "does not fit memory": 0,
                           "does not fit host memory": 0}
    if budget_bytes < 0:
        raise ValueError(f"--memory-budget-gib {budget_bytes / 2**30:g} must be 0 (no budget) or a positive number "
                         f"of GiB")
    for layout in enumerate_layouts(shape, devices, seq_len, global_batch_size, device.gpus_per_node, cp_min_seq_len,
                                    budget=budget_bytes > 0):
        if model_parallel is not None and layout.model_parallel != model_parallel:
            continue
        try:
            ranked.append(evaluate(shape, layout, device, devices, seq_len, global_batch_size, mfu, network,
                                   features, memory_headroom, budget_bytes, offload_bandwidth, host_bytes))
        except LayoutError:
            dropped["does not divide / invalid pipeline"] += 1
        except HostMemoryError:
            dropped["does not fit host memory"] += 1
        except MemoryError:
            dropped["does not fit memory"] += 1
    # Fastest first; among equals the simpler layout (fewer parallel dimensions, less recompute).
    # (Times equal to 3 significant digits are a tie: the model cannot tell them apart.)
    ranked.sort(key=lambda c: (float(f"{c.time.total:.3g}"), _complexity(c.layout)))
    return PlanResult(ranked, dropped)


def _complexity(L: Layout) -> tuple:
    return (sum(x > 1 for x in (L.dp_replicate, L.cp, L.tp, L.pp)), (*AC_MODES, BUDGET_AC).index(L.ac), -L.local_batch_size)


def explain(c: Candidate, seq_len: int, global_batch_size: int, device: Device) -> str:
    t = c.time
    parts = [f"compute {t.compute:.2f} s"]
    parts += [f"{k} exposed {v:.2f} s" for k, v in t.exposed.items()]
    if t.bubble:
        parts.append(f"pipeline bubble {100 * t.bubble:.0f}%")
    return (f"{c.layout.describe()}\n"
            f"  predicted {c.tokens_per_s_per_device:,.0f} tokens/s/device (MFU {100 * c.mfu:.0f}% of the bf16 peak), step "
            f"{t.total:.2f} s = {', '.join(parts)}\n"
            f"  peak memory {c.memory.peak / 2**30:.1f} GiB of {device.memory_bytes / 2**30:.1f} GiB "
            f"(activations {c.memory.components['activations'] / 2**30:.1f}, model states "
            f"{sum(c.memory.components[k] for k in ('parameters', 'gradients', 'optimizer state')) / 2**30:.1f})"
            + (f"; host memory {c.host_bytes / 2**30:.1f} GiB per GPU x {device.gpus_per_node} = "
               f"{c.host_bytes * device.gpus_per_node / 2**30:.0f} GiB per node (offloaded activations, pinned)"
               if c.host_bytes else ""))
