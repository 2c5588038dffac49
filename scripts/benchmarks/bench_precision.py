"""bf16 vs fp32 linear speed on this CPU, and what `mixed_precision_param = "auto"` picks here.

    python scripts/benchmarks/bench_precision.py [--size 1024] [--threads 2]
    ONEDNN_MAX_CPU_ISA=AVX2 python scripts/benchmarks/bench_precision.py     # this CPU as an AVX2-only one sees it

F.linear (the op of the model's linear layers), square, best of 10 interleaved repetitions per dtype.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchtitan.tools.precision import cpu_model_name, resolve_precision  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    x = {d: torch.randn(a.size, a.size).to(d) for d in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(x, float("inf"))
    for d in x:
        F.linear(x[d], x[d])  # warm-up
    for _ in range(10):
        for d in x:
            start = time.perf_counter()
            F.linear(x[d], x[d])
            best[d] = min(best[d], time.perf_counter() - start)
    gflops = {d: 2 * a.size**3 / s / 1e9 for d, s in best.items()}
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
    print(f"{cpu_model_name()}{f' (ONEDNN_MAX_CPU_ISA={isa})' if isa else ''}, {a.threads} threads, "
          f"{a.size}x{a.size} F.linear: fp32 {gflops[torch.float32]:.1f} GFLOP/s, bf16 "
          f"{gflops[torch.bfloat16]:.1f} GFLOP/s, bf16/fp32 {gflops[torch.bfloat16] / gflops[torch.float32]:.2f}x")
    print(resolve_precision("float32", "auto", torch.device("cpu")).reason, flush=True)


if __name__ == "__main__":
    main()
