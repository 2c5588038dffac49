"""Balanced vs even pipeline stages: predicted bottleneck (FLOPs) and measured step time, CPU PP 2.

    PYTHONPATH=$PWD python3 scripts/planning/bench_balanced_pp.py [--flavor debugmodel_tiny4] [--seq-len 256]

Prediction: module FLOPs (torchtitan/planning/balance.py module_flops) summed per stage for both splits;
the ratio of the slowest stages. Measurement: the real trainer, PP 2 over gloo, 1F1B, fp32, rounds
interleaved; median step time of the steps after the first two (scripts/bench_pipeline.py step_times).
"""

import argparse
import dataclasses
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_pipeline import step_times  # noqa: E402

from torchtitan.config.job_config import Parallelism  # noqa: E402
from torchtitan.distributed.pipeline import module_order, plan_pipeline  # noqa: E402
from torchtitan.models.llama3 import Transformer, llama3_flavors  # noqa: E402
from torchtitan.planning.balance import bottleneck, module_flops  # noqa: E402


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
    common = [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.microbatches * args.microbatch_size),
        "--parallelism.pipeline_parallel_microbatch_size", str(args.microbatch_size), "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--training.mixed_precision_param", "float32",
        "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--validation.enable", "false",
    ]
    times: dict[str, list[float]] = {"layers": [], "balanced": []}
    for _ in range(args.rounds):
        for split in times:
            times[split] += step_times(2, common + ["--parallelism.pipeline_parallel_split", split])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nCPU: {platform.processor() or platform.machine()}; {args.flavor}, seq {args.seq_len}, "
          f"{args.microbatches} microbatches, PP 2 1F1B")
    print("| split | predicted bottleneck (MFLOP/token) | median step (s) |\n|---|---|---|")
    for k in times:
        print(f"| {k} | {pred[k] / 1e6:.2f} | {med[k]:.3f} |")
    print(f"\npredicted even/balanced bottleneck: {pred['layers'] / pred['balanced']:.2f}x; "
          f"measured even/balanced step time: {med['layers'] / med['balanced']:.2f}x")


if __name__ == "__main__":
    main()
