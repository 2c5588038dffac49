"""Activation memory per rank under context parallel, on real gloo ranks.

Activation bytes = the distinct storages autograd saves for backward (torch.autograd.graph.saved_tensors_hooks),
parameters excluded, counted over one forward. Each rank holds the load-balanced seq_len/cp slice.

    # the whole model: debugmodel, batch 1, fp32; per-rank bytes at seq 8192 and the longest seq per budget
    python scripts/benchmarks/bench_cp_memory.py model --seq-len 8192 --cp 1 2 4 --budget-gib 2

    # the ring attention kernel alone (q/k/v of the given shape)
    python scripts/benchmarks/bench_cp_memory.py attention --seq-len 8192 --cp 1 2 4

With "alltoall" (point-to-point ring) only the local k/v shard is saved, so every saved tensor is per local
token and the bytes fall as 1/cp. "allgather" also keeps every rank's k/v, an O(seq_len) share per layer.
Activations are linear in the local length (attention scores are never saved), so two lengths give the
exact bytes per token, from which the longest sequence that fits a budget follows.
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.multiprocess import run_ranks  # noqa: E402
from torchtitan.distributed.context_parallel import ContextParallelAttention, shard_batch  # noqa: E402



class SavedBytes:
    """Counts each storage autograd saves once (q, k and v of one input share a storage, for example)."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


# ---------------------------------------------------------------------------------------------------------
# The whole model
# ---------------------------------------------------------------------------------------------------------


def _measure_model(rank: int, world_size: int, flavor: str, seq_len: int, attention: str, dtype: str) -> dict:
    """attention: "sdpa" (the model as built, no CP; only at cp 1) or a rotate method (ring attention)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.models.llama3.flavors import llama3_flavors
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.distributed.parallelize import apply_cp
    from torchtitan.tools.precision import DTYPES

    args = dataclasses.replace(llama3_flavors[flavor], max_seq_len=seq_len)
    torch.manual_seed(0)
    model = Transformer(args).to(DTYPES[dtype])
    model.init_weights()
    if attention != "sdpa":
        cp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
        apply_cp(model, cp_mesh, seq_len=seq_len, rotate_method=attention)
    tokens = torch.randint(0, args.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(1))
    (local,) = shard_batch((tokens,), rank, world_size)
    saved = SavedBytes(exclude=list(model.parameters()))
    dist.barrier()
    start = time.perf_counter()
    with saved.hooks():
        logits = model(local)
    seconds = time.perf_counter() - start
    del logits
    return {"saved_bytes": saved.total, "fwd_s": seconds}


def _model_bytes(cp: int, flavor: str, seq_len: int, attention: str, dtype: str) -> tuple[int, float]:
    results = run_ranks(_measure_model, cp, flavor, seq_len, attention, dtype)
    return max(r["saved_bytes"] for r in results), max(r["fwd_s"] for r in results)


def model_report(args) -> None:
    mib, gib = 2**20, 2**30
    half = args.seq_len // 2
    print(f"{args.flavor}, batch 1, {args.dtype}, seq_len {args.seq_len}; activation bytes saved for backward per rank")
    print(f"{'cp':>3} {'attention':>10} {'MiB/rank':>10} {'vs cp=1':>8} {'fwd s':>7}")
    baseline = None
    slopes: dict[int, tuple[float, float]] = {}
    for cp in args.cp:
        for attention in (["sdpa"] if cp == 1 else []) + ["alltoall", "allgather"]:
            saved, seconds = _model_bytes(cp, args.flavor, args.seq_len, attention, args.dtype)
            if attention == "alltoall":
                baseline = baseline or saved
                # A second length gives bytes = intercept + slope * seq_len exactly (everything is per token).
                saved_half, _ = _model_bytes(cp, args.flavor, half, attention, args.dtype)
                slope = (saved - saved_half) / (args.seq_len - half)
                slopes[cp] = (saved - slope * args.seq_len, slope)
            ratio = f"{saved / baseline:8.3f}" if baseline else f"{'':>8}"
            print(f"{cp:>3} {attention:>10} {saved / mib:>10.1f} {ratio} {seconds:>7.1f}")

    budget = args.budget_gib * gib
    print(f"\nlongest seq_len within {args.budget_gib:g} GiB of activations per rank (alltoall; fit from "
          f"seq_len {half} and {args.seq_len})")
    print(f"{'cp':>3} {'bytes/rank per seq token':>25} {'intercept MiB':>14} {'longest seq_len':>16} {'vs cp=1':>8}")
    first = None
    for cp, (intercept, slope) in slopes.items():
        step = 2 * cp  # seq_len must split into 2 x cp chunks
        longest = int((budget - intercept) // slope) // step * step
        first = first or longest
        print(f"{cp:>3} {slope:>25.1f} {intercept / mib:>14.2f} {longest:>16,} {longest / first:>8.2f}")


# ---------------------------------------------------------------------------------------------------------
# The attention kernel alone
# ---------------------------------------------------------------------------------------------------------


def _measure_attention(rank: int, world_size: int, shape: tuple[int, int, int, int, int], rotate_method: str) -> dict:
    batch, hq, hkv, seq_len, dim = shape
    local = seq_len // world_size
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(batch, hq, local, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, hkv, local, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, hkv, local, dim, generator=gen, requires_grad=True)
    saved = SavedBytes(exclude=[])
    dist.barrier()
    start = time.perf_counter()
    with saved.hooks():
        out = ContextParallelAttention(dist.group.WORLD, rotate_method)(q, k, v)
    out.sum().backward()
    return {"saved_bytes": saved.total, "fwd_bwd_s": time.perf_counter() - start}


def attention_report(args) -> None:
    shape = (args.batch, args.q_heads, args.kv_heads, args.seq_len, args.head_dim)
    print(f"B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} S={args.seq_len} D={args.head_dim}, fp32")
    print(f"{'cp':>3} {'rotate':>10} {'saved MiB/rank':>15} {'vs cp=1':>8} {'fwd+bwd s':>10}")
    baseline: float | None = None
    for cp in args.cp:
        for method in ("alltoall", "allgather"):
            results = run_ranks(_measure_attention, cp, shape, method)
            saved = max(r["saved_bytes"] for r in results) / 2**20
            baseline = baseline or saved
            seconds = max(r["fwd_bwd_s"] for r in results)
            print(f"{cp:>3} {method:>10} {saved:>15.2f} {saved / baseline:>8.3f} {seconds:>10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="target", required=True)
    model = sub.add_parser("model", help="a whole Llama 3 forward")
    model.add_argument("--flavor", default="debugmodel")
    model.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    model.add_argument("--budget-gib", type=float, default=2.0)
    attention = sub.add_parser("attention", help="the ring attention kernel alone")
    attention.add_argument("--batch", type=int, default=1)
    attention.add_argument("--q-heads", type=int, default=4)
    attention.add_argument("--kv-heads", type=int, default=2)
    attention.add_argument("--head-dim", type=int, default=16)
    for p in (model, attention):
        p.add_argument("--seq-len", type=int, default=8192)
        p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    model_report(args) if args.target == "model" else attention_report(args)


if __name__ == "__main__":
    main()
