"""Sliding-window attention with sinks: the blockwise kernel against an explicit [S, S] masked softmax.

    python scripts/benchmarks/bench_attention_kinds.py [--seq-lens 1024 4096] [--window 128] [--heads 8] [--reps 3]

For each sequence length, fp32, batch 1, GQA 8 query / 2 kv heads of 64, window `--window`, one sink per
head: bytes saved for backward (counted by autograd's saved-tensor hooks, exact) and the largest score tensor
one step materialises, then forward + backward time (median of --reps after a warm-up, the two interleaved).
The reference is what a kernel without window support does: the whole score matrix, masked, with the sink as
an extra column. Prints a Markdown table.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from torchtitan.models.common.attention import DOCUMENT_BLOCK, blockwise_attention


def explicit(q, k, v, window, sinks):
    b, hq, s, d = q.shape
    rep = hq // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    i, j = torch.arange(s).view(-1, 1), torch.arange(s).view(1, -1)
    scores = (q @ k.transpose(-1, -2) / d**0.5).masked_fill(~((j <= i) & (i - j < window)), float("-inf"))
    scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(b, hq, s, 1)], dim=-1)
    return scores.softmax(-1)[..., :s] @ v


def saved_bytes(fn, *args) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return total[0]


def step_time(fn, args) -> float:
    start = time.perf_counter()
    fn(*args).sum().backward()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    print("| seq | kernel | saved for backward (MiB) | largest score tensor (elements, by construction) | fwd+bwd (s) |")
    print("|---|---|---|---|---|")
    for s in a.seq_lens:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, a.heads, s, 64, generator=g, requires_grad=True)
        k = torch.randn(1, 2, s, 64, generator=g, requires_grad=True)
        v = torch.randn(1, 2, s, 64, generator=g, requires_grad=True)
        sinks = torch.randn(a.heads, generator=g, requires_grad=True)
        kernels = {
            "blockwise": (lambda *t: blockwise_attention(*t[:3], window=a.window, sinks=t[3]),
                          a.heads * DOCUMENT_BLOCK * (DOCUMENT_BLOCK + a.window - 1)),
            "explicit [S, S]": (lambda *t: explicit(*t[:3], a.window, t[3]), a.heads * s * (s + 1)),
        }
        args = (q, k, v, sinks)
        times = {name: [] for name in kernels}
        for name, (fn, _) in kernels.items():
            step_time(fn, args)  # warm-up
        for _ in range(a.reps):
            for name, (fn, _) in kernels.items():
                times[name].append(step_time(fn, args))
        for name, (fn, scores) in kernels.items():
            mib = saved_bytes(fn, *args) / 2**20
            print(f"| {s} | {name} | {mib:.1f} | {scores:,} | {statistics.median(times[name]):.3f} |")


if __name__ == "__main__":
    main()
