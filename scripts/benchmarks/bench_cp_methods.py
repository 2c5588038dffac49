"""Context-parallel methods compared: bytes each rank sends per attention layer, and step time on CPU gloo.

    # bytes per rank per layer (forward + backward), counted from the collectives the code issues, one process
    # standing in for rank 0 of a cp world over torch's "fake" process group; checked against
    # torchtitan/planning/cp_comm.py, then the formula evaluated for a Llama 3 8B layer at seq 131072
    python scripts/benchmarks/bench_cp_methods.py bytes --cp 2 4 8

    # forward + backward of a small Llama on 2 real gloo ranks (cp 2), ring vs ulysses, ratios in one run
    python scripts/benchmarks/bench_cp_methods.py time --seq-len 8192 16384

Counting: every torch.distributed call the CP kernels make is wrapped; a call's bytes per rank are
all-to-all (g-1)/g of its input, all-gather (g-1) x its input, reduce-scatter (g-1)/g of its input, a
point-to-point send the tensor. The fake group moves nothing, so the counted shapes are exactly what a real
job of that world size issues (the numbers computed on the garbage it returns are not used).
"""

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.planning.cp_comm import cp_bytes_per_layer  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# Bytes, counted
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_collectives():
    """Yields a dict that accumulates this rank's sent bytes per collective kind while the block runs."""
    sent: dict[str, float] = {}

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def add(kind: str, n: float) -> None:
        sent[kind] = sent.get(kind, 0.0) + n

    real = {name: getattr(dist, name) for name in
            ("all_to_all_single", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_single",
             "batch_isend_irecv")}

    def all_to_all_single(out, inp, *args, group=None, **kw):
        g = dist.get_world_size(group)
        add("all_to_all", (g - 1) / g * nbytes(inp))
        return real["all_to_all_single"](out, inp, *args, group=group, **kw)

    def gather(name):
        def call(out, inp, *args, group=None, **kw):
            add("all_gather", (dist.get_world_size(group) - 1) * nbytes(inp))
            return real[name](out, inp, *args, group=group, **kw)
        return call

    def reduce_scatter_single(out, inp, *args, group=None, **kw):
        g = dist.get_world_size(group)
        add("reduce_scatter", (g - 1) / g * nbytes(inp))
        return real["reduce_scatter_single"](out, inp, *args, group=group, **kw)

    def batch_isend_irecv(ops):
        add("send", sum(nbytes(op.tensor) for op in ops if op.op is dist.isend))
        return real["batch_isend_irecv"](ops)

    patched = {"all_to_all_single": all_to_all_single, "all_gather_into_tensor": gather("all_gather_into_tensor"),
               "all_gather_single": gather("all_gather_single"), "reduce_scatter_single": reduce_scatter_single,
               "batch_isend_irecv": batch_isend_irecv}
    for name, fn in patched.items():
        setattr(dist, name, fn)
    try:
        yield sent
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)


def counted_bytes(method: str, cp: int, a2a: int, rotate: str, *, batch: int, seq: int, hq: int, hkv: int,
                  d: int, documents: bool) -> float:
    """Bytes rank 0 of a cp world sends for one attention layer, forward + backward (fp32 tensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchtitan.distributed.context_parallel_a2a import cp_attention_factory
    from torchtitan.models.common.attention import ScaledDotProductAttention

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp)
    try:
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        attention = cp_attention_factory(mesh, method, a2a, rotate)(ScaledDotProductAttention())
        local = seq // cp
        q = torch.randn(batch, hq, local, d, requires_grad=True)
        k, v = (torch.randn(batch, hkv, local, d, requires_grad=True) for _ in range(2))
        ids = torch.zeros(batch, local, dtype=torch.int64) if documents else None
        with counting_collectives() as sent:
            out = attention(q, k, v) if ids is None else attention(q, k, v, ids)
            out.backward(torch.ones_like(out))
        return sum(sent.values())
    finally:
        dist.destroy_process_group()


def methods_for(cp: int) -> list[tuple[str, int, str]]:
    rows = [("ring", 0, "alltoall"), ("ring", 0, "allgather"), ("ulysses", 0, "")]
    rows += [("hierarchical", a, "alltoall") for a in range(2, cp) if cp % a == 0]
    return rows


def bench_bytes(cps: list[int]) -> None:
    # A small layer for the count (the kernels really run); bytes are linear in tokens and heads.
    shape = dict(batch=1, seq=512, hq=8, hkv=2, d=16)
    print(f"counted: one attention layer, fp32, batch {shape['batch']} x seq {shape['seq']}, "
          f"{shape['hq']} q heads / {shape['hkv']} kv heads of {shape['d']}, document masking on; KiB per rank")
    print("| cp | method | a2a | rotate | counted KiB | formula KiB |")
    print("|---|---|---|---|---|---|")
    for cp in cps:
        for method, a2a, rotate in methods_for(cp):
            got = counted_bytes(method, cp, a2a, rotate or "alltoall", documents=True, **shape)
            want = cp_bytes_per_layer(method, cp, a2a, tokens=shape["batch"] * shape["seq"] // cp, hq=shape["hq"],
                                      hkv=shape["hkv"], d=shape["d"], act_bytes=4, rotate=rotate or "alltoall",
                                      documents=True)
            flag = "" if abs(got - want) <= 1e-6 * max(1.0, want) else "  MISMATCH"
            print(f"| {cp} | {method} | {a2a or cp if method != 'ring' else '-'} | {rotate or '-'} | "
                  f"{got / 1024:.1f} | {want / 1024:.1f}{flag} |")
    # The verified formula at a real shape: Llama 3 8B (32 q heads, 8 kv heads of 128), seq 131072, bf16,
    # batch 1, no tensor parallel, no documents.
    seq = 131072
    print(f"\nformula: Llama 3 8B attention layer, bf16, seq {seq}, batch 1; MiB sent per rank (fwd + bwd)")
    print("| cp | ring (p2p) | ring (allgather) | ulysses | hierarchical (a2a degree: MiB) |")
    print("|---|---|---|---|---|")
    for cp in (2, 4, 8, 16, 32):
        f = dict(tokens=seq // cp, hq=32, hkv=8, d=128, act_bytes=2)
        mib = [cp_bytes_per_layer("ring", cp, 0, rotate=r, **f) / 2**20 for r in ("alltoall", "allgather")]
        uly = cp_bytes_per_layer("ulysses", cp, 0, **f) / 2**20 if 32 % cp == 0 else None
        hier = ", ".join(f"{a}: {cp_bytes_per_layer('hierarchical', cp, a, **f) / 2**20:.0f}"
                         for a in range(2, cp) if cp % a == 0 and 32 % a == 0)
        print(f"| {cp} | {mib[0]:.0f} | {mib[1]:.0f} | {'%.0f' % uly if uly is not None else 'heads'} | "
              f"{hier or '-'} |")


# ---------------------------------------------------------------------------------------------------------
# Step time on real gloo ranks
# ---------------------------------------------------------------------------------------------------------


def apply_warmup(model, rank: int, world_size: int) -> None:
    """One forward + backward at the model's own length would double the run; a short one loads the kernels.
    (The model's positions are fixed to its sequence length, so the warm-up runs the attention alone.)"""
    for block in model.layers.values():
        att = block.attention.inner_attention
        q = torch.randn(1, 4, 256 // world_size, 32, requires_grad=True)
        kv = torch.randn(1, 2, 256 // world_size, 32, requires_grad=True)
        att(q, kv, kv).sum().backward()
        break


def _time_rank(rank: int, world_size: int, seq_lens: list[int], reps: int) -> dict:
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan.distributed.context_parallel import shard_batch
    from torchtitan.distributed.parallelize import apply_cp
    from torchtitan.models.llama3.args import TransformerModelArgs
    from torchtitan.models.llama3.model import Transformer

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    results = {}
    for seq in seq_lens:
        torch.manual_seed(0)
        args = TransformerModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048,
                                    multiple_of=64, max_seq_len=seq)
        base = Transformer(args)
        base.init_weights()
        tokens = torch.randint(0, 2048, (1, seq), generator=torch.Generator().manual_seed(1))
        (local,) = shard_batch((tokens,), rank, world_size)
        # Each method's reps interleaved with the other's, so a change of the machine's load hits both alike.
        models = {}
        for method, rotate in (("ring", "alltoall"), ("ulysses", "alltoall")):
            m = copy.deepcopy(base)
            apply_cp(m, mesh, seq_len=seq, rotate_method=rotate, method=method)
            models[method] = m
        times: dict[str, list[float]] = {name: [] for name in models}
        for name, m in models.items():  # warm-up on a short prefix-free input: one layer's worth of dispatch
            apply_warmup(m, rank, world_size)
        for _ in range(reps):
            for name, m in models.items():
                dist.barrier()
                t0 = time.perf_counter()
                m(local).float().square().mean().backward()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
        results[seq] = {name: statistics.median(t) for name, t in times.items()}
    return results


def bench_time(seq_lens: list[int], reps: int) -> None:
    from tests.multiprocess import run_ranks

    res = run_ranks(_time_rank, 2, seq_lens, reps, timeout=7200)[0]
    print("forward + backward of a 2-layer Llama (dim 128, 4 q / 2 kv heads of 32), batch 1, fp32, cp 2 on 2 gloo "
          f"ranks, median of {reps}; ring = point-to-point rotation; ring runs its own fp32 blockwise math, ulysses the "
          "model's kernel (torch SDPA)")
    print("| seq_len | ring s | ulysses s | ring / ulysses |")
    print("|---|---|---|---|")
    for seq, t in res.items():
        print(f"| {seq} | {t['ring']:.2f} | {t['ulysses']:.2f} | {t['ring'] / t['ulysses']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    b = sub.add_parser("bytes")
    b.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    t = sub.add_parser("time")
    t.add_argument("--seq-len", type=int, nargs="+", default=[8192, 16384])
    t.add_argument("--reps", type=int, default=1)
    a = parser.parse_args()
    if a.what == "bytes":
        bench_bytes(a.cp)
    else:
        bench_time(a.seq_len, a.reps)


if __name__ == "__main__":
    main()
