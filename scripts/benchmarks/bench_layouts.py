"""Throughput and memory per parallel layout, through the real launcher path (torchrun -m torchtitan.train).

Each layout trains the same recipe for a few steps; the figures are read back from metrics.jsonl (median of
the logged steps after the first, which includes start-up). Layouts run one after another; run the script
twice and compare if the machine is noisy.

CPU (gloo; ranks share the cores, OMP_NUM_THREADS=1 each, so tokens/s per device falls as ranks are added):
    python scripts/benchmarks/bench_layouts.py
GPU (e.g. a lent 8-GPU box; FSDP vs DDP-equivalent throughput and memory on an 8B-shaped model cut to fit):
    python scripts/benchmarks/bench_layouts.py --ngpu 8 --flavor 8B --layouts fsdp,ddp,hsdp,tp2_fsdp \\
        --seq-len 4096 --local-batch 1 --steps 30 --extra --training.mixed_precision_param=bfloat16
    Results also go to $OUT/layouts.json when OUT is set.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def layouts(n: int) -> dict[str, tuple[int, list[str]]]:
    half = max(n // 2, 1)
    return {
        "single": (1, []),
        "fsdp": (n, ["--parallelism.data_parallel_shard_degree", str(n)]),
        "ddp": (n, ["--parallelism.data_parallel_replicate_degree", str(n), "--parallelism.data_parallel_shard_degree", "1"]),
        "hsdp": (n, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", str(half)]),
        "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
        "tp2_fsdp": (n, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", str(half)]),
    }


def run_layout(name, world, argv, args) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "torchtitan.train",
               "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.local_batch), "--training.steps", str(args.steps),
               "--metrics.log_freq", "1", "--job.dump_folder", dump, *argv, *args.extra]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            return {"layout": name, "world": world, "error": (p.stderr or p.stdout).strip().splitlines()[-1]}
        steps = [json.loads(x) for x in Path(dump, "metrics.jsonl").read_text().splitlines()]
        steps = [m for m in steps if "loss" in m and m["step"] > 2]
    mem_key = next((k for k in ("memory/max_reserved_gib", "memory/peak_rss_gib") if k in steps[0]), None)
    tps = [m["tps"] for m in steps]
    return {
        "layout": name, "world": world,
        "tps_per_device": statistics.median(tps), "tps_min": min(tps), "tps_max": max(tps),
        "mfu_pct": statistics.median(m["mfu"] for m in steps),
        "memory_gib": max(m[mem_key] for m in steps) if mem_key else None, "memory_kind": mem_key,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ngpu", type=int, default=4, help="ranks for the multi-rank layouts")
    p.add_argument("--layouts", default="single,fsdp,ddp,hsdp,tp2,tp2_fsdp")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer options")
    args = p.parse_args()
    table = layouts(args.ngpu)
    rows = [run_layout(n, *table[n], args) for n in args.layouts.split(",")]
    print(f"flavor {args.flavor}, seq {args.seq_len}, local batch {args.local_batch}, {args.steps} steps, "
          f"median of steps 3..{args.steps}")
    print(f"{'layout':>10} {'ranks':>5} {'tok/s/device':>13} {'min':>8} {'max':>8} {'MFU %':>6} {'memory GiB':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['layout']:>10} {r['world']:>5}  failed: {r['error']}")
            continue
        mem = f"{r['memory_gib']:.2f}" if r["memory_gib"] is not None else "-"
        print(f"{r['layout']:>10} {r['world']:>5} {r['tps_per_device']:13,.0f} {r['tps_min']:8,.0f} "
              f"{r['tps_max']:8,.0f} {r['mfu_pct']:6.1f} {mem:>11}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "layouts.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
