"""Bytes saved for backward per rank by ContextParallelAttention, for several cp sizes and rotate methods.

Counts every tensor autograd packs (torch.autograd.graph.saved_tensors_hooks) during one forward of the ring
attention on real gloo ranks, and prints a table. With "alltoall" only the local shard is kept, so the bytes
should fall as 1/cp; "allgather" keeps all ranks' k/v, so its k/v share stays O(S).

    python scripts/bench_cp_memory.py --seq-len 8192 --cp 1 2 4
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.multiprocess import run_ranks  # noqa: E402
from torchtitan.distributed.context_parallel import ContextParallelAttention  # noqa: E402


def _measure(rank: int, world_size: int, shape: tuple[int, int, int, int, int], rotate_method: str) -> dict:
    batch, hq, hkv, seq_len, dim = shape
    local = seq_len // world_size
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, hq, local, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, hkv, local, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, hkv, local, dim, generator=gen, requires_grad=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    dist.barrier()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = ContextParallelAttention(dist.group.WORLD, rotate_method)(q, k, v)
    out.sum().backward()
    return {"saved_bytes": sum(saved), "fwd_bwd_s": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--q-heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    shape = (args.batch, args.q_heads, args.kv_heads, args.seq_len, args.head_dim)

    print(f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} S={args.seq_len} D={args.head_dim}, fp32")
    print(f"{'cp':>3} {'rotate':>10} {'saved MiB/rank':>15} {'vs cp=1':>8} {'fwd+bwd s':>10}")
    baseline: float | None = None
    for cp in args.cp:
        for method in ("alltoall", "allgather"):
            results = run_ranks(_measure, cp, shape, method)
            saved = max(r["saved_bytes"] for r in results) / 2**20
            if baseline is None:
                baseline = saved
            seconds = max(r["fwd_bwd_s"] for r in results)
            print(f"{cp:>3} {method:>10} {saved:>15.2f} {saved / baseline:>8.3f} {seconds:>10.2f}")


if __name__ == "__main__":
    main()
