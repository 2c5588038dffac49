"""Muon's optimizer step per rank under FSDP: Newton-Schulz once per matrix (owner ranks) against every
rank orthogonalising every matrix (the implementation before it), in one run.

    python scripts/benchmarks/bench_muon_step.py [--ranks 4] [--dim 512] [--ffn 1536] [--kv-dim 128] [--layers 4] [--reps 3]

Each of `--ranks` gloo processes (one thread each, as torchrun sets) holds FSDP's Shard(0) of the Muon
matrices of `--layers` Llama blocks (wq, wo: dim x dim; wk, wv: kv_dim x dim; w1, w3: ffn x dim; w2:
dim x ffn), fp32 gradients, Newton-Schulz in fp32, and times `MuonWithAdamW.step()` with each scheme,
alternating; medians after one warm-up, the slowest rank's time per step. Both schemes' updates are
compared bit for bit. Note: on a CPU with fewer cores than ranks the ranks share cores, so the all-ranks
scheme pays its repeated work in shared CPU time as well; the per-rank Newton-Schulz FLOPs are printed too.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy


class _EveryRank:
    """The implementation before distributed Muon: all-gather each matrix, orthogonalise it on every rank,
    keep the local shard."""

    def __init__(self, ns_flops, steps):
        self.flops_done, self._ns_flops, self._steps = 0, ns_flops, steps

    def __call__(self, updates, steps, ns):
        from torch.distributed.tensor import DTensor, Replicate

        out = []
        for u in updates:
            ortho = ns(u.full_tensor())
            self.flops_done += self._ns_flops(tuple(u.shape), steps)
            full = DTensor.from_local(ortho, u.device_mesh, [Replicate()], run_check=False)
            out.append(full.redistribute(u.device_mesh, u.placements))
        return out


def _rank(rank, world_size, a):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchtitan.components.optim.muon import MuonWithAdamW
    from torchtitan.components.optim.muon_distributed import DistributedOrthogonaliser, ns_flops

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    shapes = [(a.dim, a.dim), (a.kv_dim, a.dim), (a.kv_dim, a.dim), (a.dim, a.dim),
              (a.ffn, a.dim), (a.dim, a.ffn), (a.ffn, a.dim)] * a.layers
    g = torch.Generator().manual_seed(0)
    schemes = {"once per matrix": DistributedOrthogonaliser(), "every rank": _EveryRank(ns_flops, 5)}
    params, grads, optimizers = {}, [torch.randn(*s, generator=g) for s in shapes], {}
    for name in schemes:
        params[name] = [torch.nn.Parameter(distribute_tensor(torch.zeros(s), mesh, [Shard(0)])) for s in shapes]
        for p, grad in zip(params[name], grads):
            p.grad = distribute_tensor(grad, mesh, [Shard(0)])
        opt = MuonWithAdamW([{"params": params[name], "use_muon": True}], lr=0.01, weight_decay=0.0,
                            betas=(0.9, 0.95), eps=1e-8, momentum=0.95, nesterov=True, ns_steps=5,
                            ns_dtype="float32", update_rms=0.2)
        opt.orthogonaliser = schemes[name]
        optimizers[name] = opt
    times = {name: [] for name in schemes}
    for rep in range(a.reps + 1):
        for name, opt in optimizers.items():
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            dist.barrier()  # the step is done when the slowest rank is
            if rep:
                times[name].append(time.perf_counter() - t0)
    same = all(torch.equal(x.to_local(), y.to_local()) for x, y in zip(*params.values()))
    flops = {name: s.flops_done / (a.reps + 1) for name, s in schemes.items()}
    return times, flops, same, sum(ns_flops(s, 5) for s in shapes)


def main() -> None:
    from tests.multiprocess import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--kv-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    results = run_ranks(_rank, a.ranks, a)
    times, _, same, total = results[0]
    print(f"Muon step, FSDP {a.ranks} (gloo, 1 thread per rank), {a.layers} blocks of dim {a.dim}, ffn {a.ffn}, "
          f"kv_dim {a.kv_dim}, fp32 Newton-Schulz, torch {torch.__version__}")
    print("| scheme | step time (s, median, slowest rank) | Newton-Schulz GFLOP per rank per step (max / total) |")
    print("|---|---|---|")
    for name in times:
        per_rank = [r[1][name] for r in results]
        print(f"| {name} | {statistics.median(times[name]):.3f} ({min(times[name]):.3f}-{max(times[name]):.3f}) | "
              f"{max(per_rank) / 1e9:.2f} / {total / 1e9:.2f} |")
    every, once = (statistics.median(times[n]) for n in ("every rank", "once per matrix"))
    print(f"step time every-rank / once-per-matrix: {every / once:.2f}x; updates bit-identical: {same}")


if __name__ == "__main__":
    main()
