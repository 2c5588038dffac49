"""Memory estimator vs measured peak on CPU, for runs that differ in layout and activation checkpointing.

    PYTHONPATH=$PWD python3 scripts/planning/bench_memory.py [--only NAME ...]

Measured: the real trainer over gloo trains one step (so optimizer state exists), then one more step runs
under torch.profiler(profile_memory=True). While profiling, c10's CPU allocator keeps a running total of
the bytes it has handed out and reports it with every allocation and free; the peak is the bytes live
when profiling began (the rank's tensors: parameter shards, optimizer state, buffers, the batch; counted
from the objects) plus the largest running total during the step. This is what the CPU allocator really hands out to tensors (malloc's own
bookkeeping is not included). Rank 0's figure is reported (the ranks of these layouts are symmetric, but
for PP, where each pp rank is measured and the largest is reported).

Estimated: torchtitan/planning/memory.py estimate_memory with the rank's real shard sizes (as the dry run
gives them) and the layout's activation formula.
"""

import argparse
import dataclasses
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUNS = {  # name: (world, extra args)
    "1 rank, AC none": (1, []),
    "1 rank, AC full": (1, ["--activation_checkpoint.mode", "full"]),
    "1 rank, AC selective op": (1, ["--activation_checkpoint.mode", "selective"]),
    # 405B's kind of layout in miniature: PP x FSDP (x TP) in bf16 with full AC, where the gathered stage and the
    # unsharded fp32 gradients that FSDP accumulates over the microbatches weigh most.
    **{f"PP 2 x FSDP 2{tp} {s}, 8 microbatches, AC full, bf16": (
        4 * n, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                "--parallelism.tensor_parallel_degree", str(n), "--parallelism.pipeline_parallel_schedule", s,
                "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatch_size", "1",
                "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"])
       for s in ("1F1B", "Interleaved1F1B") for n, tp in ((1, ""), (2, " x TP 2"))},
    "FSDP 2, AC selective op, bf16": (2, ["--activation_checkpoint.mode", "selective",
                                          "--training.mixed_precision_param", "bfloat16"]),
    # Compile and Float8, which the estimator does not model (the planner's recipes turn compile on with
    # Float8 and async TP): how far off it is with them, on CPU (Float8 emulated: torchao's casts, fp32 GEMMs).
    **{f"1 rank, AC {name}, compile": (1, ["--activation_checkpoint.mode", m, "--compile.enable"])
       for m, name in (("none", "none"), ("selective", "selective op"), ("full", "full"))},
    "1 rank, AC none, Float8 emulated": (1, ["--model.converters", "float8", "--float8.emulate"]),
    "1 rank, AC none, Float8 emulated, compile": (1, ["--model.converters", "float8", "--float8.emulate",
                                                      "--compile.enable"]),
    "1 rank, AC none, chunked loss 64": (1, ["--training.loss_chunk_size", "64"]),
    "FSDP 2, AC none": (2, []),
    "FSDP 2, AC full": (2, ["--activation_checkpoint.mode", "full"]),
    "TP 2, AC none": (2, ["--parallelism.tensor_parallel_degree", "2"]),
    "FSDP 2, grad accum 2, AC selective op": (2, ["--activation_checkpoint.mode", "selective",
                                                  "--training.global_batch_size", "16"]),
    "PP 2 1F1B, AC none": (2, ["--parallelism.pipeline_parallel_degree", "2",
                               "--model.flavor", "debugmodel_tiny4"]),
    # Every schedule the trainer runs, 8 microbatches of one sequence, so that the in-flight activations
    # (which differ by schedule) dominate.
    **{f"PP 2 {s}, 8 microbatches": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.pipeline_parallel_schedule", s,
                                         "--training.local_batch_size", "8",
                                         "--parallelism.pipeline_parallel_microbatch_size", "1"])
       for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                 "DualPipeV")},
    # The split-backward schedules with full AC: the input pass recomputes, and what it recomputed waits for
    # the weight pass. (With op-selective AC they cannot run: plan_job refuses it.)
    **{f"PP 2 {s}, 8 microbatches, AC full": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                                  "--parallelism.pipeline_parallel_schedule", s,
                                                  "--training.local_batch_size", "8",
                                                  "--parallelism.pipeline_parallel_microbatch_size", "1",
                                                  "--activation_checkpoint.mode", "full"])
       for s in ("1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")},
    # torch before 2025 kept every microbatch's output on the last stage for the schedule's return value (the
    # published 405B runs'); the trainer passes return_outputs=False, these rows pass True as that torch did.
    **{f"PP 2 {s}, 8 microbatches, outputs kept": (2, ["--parallelism.pipeline_parallel_degree", "2",
                                                       "--parallelism.pipeline_parallel_schedule", s,
                                                       "--training.local_batch_size", "8",
                                                       "--parallelism.pipeline_parallel_microbatch_size", "1",
                                                       "--activation_checkpoint.mode", "full"])
       for s in ("1F1B", "Interleaved1F1B")},
}
KEEP_OUTPUTS = {name for name in RUNS if name.endswith("outputs kept")}
COMMON = [
    "--model.flavor", "debugmodel", "--training.seq_len", "512", "--training.local_batch_size", "4",
    "--training.mixed_precision_param", "float32", "--training.steps", "1", "--validation.enable", "false",
    "--metrics.log_freq", "1", "--debug.seed", "0",
]


def _live_tensor_bytes(trainer) -> int:
    from torchtitan.tools.memory import local_state_bytes

    s = local_state_bytes(trainer.model_parts, trainer.optimizers)
    buffers = sum(b.numel() * b.element_size() for m in trainer.model_parts for b in m.buffers())
    return s["params"] + s["grads"] + s["optimizer"] + buffers


def _recv_buffer_bytes(trainer) -> int:
    """PP receive buffers: torch's PipelineStage allocates them in the first step and keeps them, so they are
    alive when profiling begins and never enter the profiler's running total."""
    if trainer.pipeline is None:
        return 0
    sched = trainer.pipeline.schedule
    stages = getattr(sched, "_stages", None) or [sched._stage]
    seen, total = set(), 0
    for st in stages:
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                buf = getattr(info, "buffer", None)
                if isinstance(buf, torch.Tensor) and buf.untyped_storage().data_ptr() not in seen:
                    seen.add(buf.untyped_storage().data_ptr())
                    total += buf.untyped_storage().nbytes()
    return total


def _release_local_transfers(trainer) -> None:
    """V schedules pass activations and gradients between a rank's two adjacent stages without a send: torch
    points the receiving stage's buffer at the tensor itself (`set_local_fwd_input` / `set_local_bwd_input`),
    dropping the previous step's as each microbatch replaces it. The profiler cannot see the free of a block
    allocated before it started, so those would count twice (the old in the baseline, the new in the running
    total). Released here before the profiled step; each is set again before it is read."""
    if trainer.pipeline is None:
        return
    sched = trainer.pipeline.schedule
    stages = getattr(sched, "_stages", None) or [sched._stage]
    local = {st.stage_index for st in stages}
    for st in stages:
        for neighbour, infos in ((st.stage_index - 1, st.args_recv_info), (st.stage_index + 1, st.grad_recv_info)):
            if neighbour in local:
                for info in (i for per_mb in infos.values() for i in per_mb):
                    info.buffer = None


def _local_numel(t) -> int:
    return t.to_local().numel() if hasattr(t, "to_local") else t.numel()


def _peak_allocated(prof) -> int:
    """Largest total of bytes c10's CPU allocator had handed out (and not yet taken back) among the
    allocations made while profiling: its own running total, reported with every allocation event."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            peak = max(peak, node.typed[1].total_allocated)
        stack.extend(node.children)
    return peak


def _stage_shares(parts) -> tuple[float, ...] | None:
    """Each local pipeline stage's share of the rank's trainable parameter elements (parts in stage order)."""
    counts = [sum(_local_numel(p) for p in m.parameters() if p.requires_grad) for m in parts]
    return tuple(n / sum(counts) for n in counts) if len(counts) > 1 else None


def _measure(rank, world, argv, folder, keep_outputs=False):
    from torch.profiler import ProfilerActivity, profile

    from torchtitan.config import ConfigManager
    from torchtitan.planning.memory import ModelShape, StateBytes, estimate_memory, rank_work
    from torchtitan.tools.memory import local_state_bytes
    from torchtitan.trainer import Trainer

    cfg = ConfigManager().parse_args(COMMON + argv + ["--job.dump_folder", folder])
    trainer = Trainer(cfg)
    if keep_outputs:  # as torch's schedules did before `return_outputs` (2025): the last stage keeps its outputs
        step = trainer.pipeline.schedule.step
        trainer.pipeline.schedule.step = lambda *a, return_outputs=True, **k: step(*a, return_outputs=True, **k)
    try:
        trainer.train()  # one step: optimizer state exists from here on
        data = iter(trainer.dataloader)
        mbs = trainer._next_microbatches(data)
        data_bytes = sum(t.numel() * t.element_size() for mb in mbs for t in mb)
        # (Rows measured before 2026-12-04 19:00 UTC left the receive buffers out: docs/planning.md says which.)
        _release_local_transfers(trainer)  # (rows of V schedules measured before 2026-12-06 23:30 UTC counted them twice)
        baseline = _live_tensor_bytes(trainer) + data_bytes + _recv_buffer_bytes(trainer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.train_step(mbs)
        peak = _peak_allocated(prof)
        s = local_state_bytes(trainer.model_parts, trainer.optimizers)
        buffers = sum(b.numel() * b.element_size() for m in trainer.model_parts for b in m.buffers())
        parts = trainer.model_parts
        pd = trainer.parallel_dims
        shape = ModelShape.from_args(trainer.model_args)
        work = rank_work(
            cfg, pd, trainer.grad_accum, blocks=sum(len(m.layers) for m in parts), shape=shape,
            holds_embedding=any(getattr(m, "tok_embeddings", None) is not None for m in parts),
            holds_output=any(getattr(m, "output", None) is not None for m in parts),
            pp_rank=pd.coordinate("pp")[0], stages_per_rank=len(parts),
            fsdp_shard_params=sum(_local_numel(p) for m in parts for p in m.parameters() if p.requires_grad),
            stage_shares=_stage_shares(parts),
        )
        if keep_outputs and work.holds_output:
            work = dataclasses.replace(work, pp_kept_outputs=trainer.pipeline.plan.n_microbatches)
        state = StateBytes(params=s["params"], grads=s["params"], optimizer=s["optimizer"], buffers=buffers)
        estimate = estimate_memory(shape, state, work)
        return baseline + peak, estimate
    finally:
        trainer.close()


def main() -> None:
    import tempfile

    from tests.multiprocess import run_ranks

    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    rows = []
    for name, (world, extra) in RUNS.items():
        if args.only and name not in args.only:
            continue
        results = run_ranks(_measure, world, extra, tempfile.mkdtemp(prefix="bench_mem_"), name in KEEP_OUTPUTS)
        measured, est = max(results, key=lambda r: r[0])
        rows.append((name, measured, est))
        for rank, (m, e) in enumerate(results):  # every rank: the highest is the row, the others show where
            print(f"{name}, rank {rank}: measured {m / 2**20:.1f} MiB, estimated {e.peak / 2**20:.1f} MiB", flush=True)
            print(e.table(), flush=True)
    print(f"\nCPU: {platform.processor() or platform.machine()}, torch {torch.__version__}; debugmodel fp32, "
          f"seq 512, local batch 4\n")
    print("| run | measured peak MiB | estimated MiB | estimate / measured |\n|---|---|---|---|")
    for name, m, e in rows:
        print(f"| {name} | {m / 2**20:.1f} | {e.peak / 2**20:.1f} | {e.peak / m:.3f} |")


if __name__ == "__main__":
    main()
