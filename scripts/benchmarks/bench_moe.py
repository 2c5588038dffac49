"""Tokens/s of an MoE model without and with expert parallel, through the real launcher path.

Layouts (same recipe, same global batch per step):
    ep1   FSDP over the ranks, every rank holds all routed experts (no all-to-all)
    ep2   FSDP over the ranks, routed experts split over 2 ranks, tokens dispatched by all-to-all
With --tp N, the two ways to split the experts under tensor parallel N instead:
    etpN      expert tensor parallel (EP 1): every expert's hidden units split over the tp ranks
    epN_tpN   expert parallel over the tp ranks: whole experts, tokens dispatched by all-to-all
Figures are per device, the median of the logged steps after the first two (see scripts/benchmarks/bench_layouts.py).

CPU (gloo, 2 ranks sharing the cores):
    python scripts/benchmarks/bench_moe.py
    python scripts/benchmarks/bench_moe.py --tp 2
GPU (e.g. 8 GPUs, the 16B flavor cut to 4 layers):
    python scripts/benchmarks/bench_moe.py --ngpu 8 --flavor 16B --ep 8 --seq-len 4096 --local-batch 1 \\
        --extra --training.mixed_precision_param=bfloat16
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_layouts import run_layout  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ngpu", type=int, default=2, help="ranks")
    p.add_argument("--ep", type=int, default=2, help="expert-parallel degree of the EP layout")
    p.add_argument("--model", default="deepseek_v3")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--local-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tp", type=int, default=0,
                   help="compare expert tensor parallel with EP = tp under this TP degree (instead of ep1 / ep)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer options")
    args = p.parse_args()
    args.extra = ["--model.name", args.model, *args.extra]
    fsdp = ["--parallelism.data_parallel_shard_degree", str(args.ngpu)]
    if args.tp:
        tp = ["--parallelism.tensor_parallel_degree", str(args.tp)]
        rows = [
            run_layout(f"etp{args.tp}", args.ngpu, tp, args),
            run_layout(f"ep{args.tp}_tp{args.tp}", args.ngpu,
                       tp + ["--parallelism.expert_parallel_degree", str(args.tp)], args),
        ]
    else:
        rows = [
            run_layout("ep1", args.ngpu, fsdp, args),
            run_layout(f"ep{args.ep}", args.ngpu, fsdp + ["--parallelism.expert_parallel_degree", str(args.ep)], args),
        ]
    print(f"{args.model} {args.flavor}, {args.ngpu} ranks, seq {args.seq_len}, local batch {args.local_batch}, "
          f"{args.steps} steps, median of steps 3..{args.steps}")
    print(f"{'layout':>8} {'tok/s/device':>13} {'min':>8} {'max':>8} {'memory GiB':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:>8}  failed: {r['error']}")
            continue
        mem = f"{r['memory_gib']:.2f}" if r["memory_gib"] is not None else "-"
        print(f"{r['layout']:>8} {r['tps_per_device']:13,.0f} {r['tps_min']:8,.0f} {r['tps_max']:8,.0f} {mem:>11}")
    if all("error" not in r for r in rows):
        ratio = rows[1]["tps_per_device"] / rows[0]["tps_per_device"]
        print(f"{rows[1]['layout']} / {rows[0]['layout']} throughput: {ratio:.2f}")


if __name__ == "__main__":
    main()
