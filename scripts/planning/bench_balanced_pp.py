"""Balanced vs even pipeline stages: predicted bottleneck (FLOPs) and measured step time, CPU PP 2.

    PYTHONPATH=$PWD python3 scripts/planning/bench_balanced_pp.py [--flavor debugmodel_tiny4] [--seq-len 256]

Prediction: module FLOPs (torchtitan/distributed/balance.py module_flops) summed per stage for both splits;
the ratio of the slowest stages. Measurement: the real trainer, PP 2 over gloo, 1F1B, fp32, rounds
interleaved; median step time of the steps after the first two (scripts/benchmarks/bench_pipeline.py step_times),
and, in a second run of each, the busiest rank's CPU seconds per step (robust to a shared machine's load).
"""

import argparse
import os
import dataclasses
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts" / "benchmarks")]

from bench_pipeline import step_times  # noqa: E402

from torchtitan.config.job_config import Parallelism  # noqa: E402
from torchtitan.distributed.pipeline import module_order, plan_pipeline  # noqa: E402
from torchtitan.models.llama3 import Transformer, llama3_flavors  # noqa: E402
from torchtitan.distributed.balance import bottleneck, module_flops  # noqa: E402


def output_over_block(flavor: str, seq_len: int) -> float:
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=2048)
    with torch.device("meta"):
        model = Transformer(args)
    order = module_order(model, ("tok_embeddings",), ("norm", "output"))
    costs = module_flops(model, order, args.flops_per_token(0, seq_len) / args.n_layers)
    return costs[-1] / costs[1]


def predicted(flavor: str, seq_len: int, microbatches: int) -> dict[str, float]:
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=2048)  # the shipped tokenizer's vocabulary
    with torch.device("meta"):
        model = Transformer(args)
    order = module_order(model, ("tok_embeddings",), ("norm", "output"))
    costs = module_flops(model, order, args.flops_per_token(0, seq_len) / args.n_layers)
    out = {}
    for split in ("layers", "balanced"):
        plan = plan_pipeline(Parallelism(pipeline_parallel_degree=2, pipeline_parallel_split=split), order, 1, 2,
                             microbatches, costs)
        sizes = [len(s) for s in plan.stages]
        out[split] = bottleneck(costs, sizes)
        print(f"{split:>8}: stages {[list(s) for s in plan.stages]}  bottleneck {out[split] / 1e6:.2f} MFLOP/token")
    return out


def measured_block_vs_output(flavor: str, seq_len: int, microbatch_size: int, reps: int = 5) -> tuple[float, float]:
    """Median forward+backward CPU seconds of one block and of norm + output + loss, one microbatch, fp32
    (process CPU time: robust to other jobs on the machine)."""
    import time

    from torchtitan.components.loss import cross_entropy_sum

    torch.set_num_threads(1)  # as each training rank runs; idle OpenMP threads would spin and bill CPU time
    args = dataclasses.replace(llama3_flavors[flavor], vocab_size=2048)
    model = Transformer(args)
    h = torch.randn(microbatch_size, seq_len, args.dim, requires_grad=True)
    labels = torch.randint(0, 2048, (microbatch_size, seq_len))
    block = model.layers["0"]
    rope = model.rope_cache

    def run_block():
        block(h, rope, None).sum().backward()

    def run_output():
        cross_entropy_sum(model.output(model.norm(h)), labels).backward()

    out = []
    for fn in (run_block, run_output):
        times = []
        for _ in range(reps + 1):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        out.append(statistics.median(times[1:]))
    return out[0], out[1]


def _train_cpu_seconds(rank, world_size, argv, folder):
    """CPU seconds this rank's process spent in trainer.train() (all its threads)."""
    import time

    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    trainer = Trainer(config_manager().parse_args(argv + ["--job.dump_folder", folder]))
    try:
        start = time.process_time()
        trainer.train()
        return time.process_time() - start
    finally:
        trainer.close()


def busiest_rank_cpu_per_step(argv: list[str], steps: int) -> float:
    """The busiest rank's CPU seconds per step: what bounds the step on cores of its own, whatever else
    the machine runs (wall time on a shared machine is set by the scheduler, not by the stage's work)."""
    import tempfile

    from tests.multiprocess import run_ranks

    return max(run_ranks(_train_cpu_seconds, 2, argv, tempfile.mkdtemp(prefix="bench_bal_"))) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="debugmodel_tiny4")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    pred = predicted(args.flavor, args.seq_len, args.microbatches)
    t_block, t_out = measured_block_vs_output(args.flavor, args.seq_len, args.microbatch_size)
    print(f"measured fwd+bwd CPU time per microbatch: block {1e3 * t_block:.1f} ms, norm+output+loss {1e3 * t_out:.1f} ms "
          f"(output/block {t_out / t_block:.2f}; by FLOPs {output_over_block(args.flavor, args.seq_len):.2f})")
    common = [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.microbatches * args.microbatch_size),
        "--parallelism.pipeline_parallel_microbatch_size", str(args.microbatch_size), "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--validation.enable", "false",
    ]
    times: dict[str, list[float]] = {"layers": [], "balanced": []}
    cpu: dict[str, list[float]] = {"layers": [], "balanced": []}
    for _ in range(args.rounds):
        for split in times:
            argv = common + ["--parallelism.pipeline_parallel_split", split]
            times[split] += step_times(2, argv)
            cpu[split].append(busiest_rank_cpu_per_step(argv, args.steps))
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"\nCPU: {platform.processor() or platform.machine()}; {args.flavor}, seq {args.seq_len}, "
          f"{args.microbatches} microbatches of {args.microbatch_size}, PP 2 1F1B; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| split | predicted bottleneck (MFLOP/token) | median wall step (s) | busiest rank CPU s/step |")
    print("|---|---|---|---|")
    for k in times:
        print(f"| {k} | {pred[k] / 1e6:.2f} | {med[k]:.3f} | {cpu_med[k]:.3f} |")
    print(f"\npredicted even/balanced bottleneck: {pred['layers'] / pred['balanced']:.2f}x; measured even/balanced: "
          f"wall step {med['layers'] / med['balanced']:.2f}x, busiest rank CPU {cpu_med['layers'] / cpu_med['balanced']:.2f}x")


if __name__ == "__main__":
    main()
