"""Save and load throughput of a checkpoint on a local folder vs. an S3 server (moto on loopback), from 1, 2
and 4 ranks, through the trainer's own path (checksummed DCP writer, storage layer, DCP reader).

    python scripts/benchmarks/storage_throughput.py [--params 100e6] [--worlds 1,2,4] [--repeats 2]

The state is `params` fp32 parameters in 1M-element tensors, split evenly over the ranks (each rank writes and
reads only its own file, as under FSDP). For each world size, the local folder and the S3 server alternate,
`repeats` times; a row gives the median seconds (barrier to barrier) and MB/s of: a synchronous save, an async
save's blocking time (staging; the write goes on in the background) and its total, and a load. The S3 server is
moto in server mode, a pure-Python server sharing this machine's cores, so its figures are a floor for what a
real store gives; what they show is the client's overhead and that the async save blocks as long as locally.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TENSOR = 1 << 20  # elements per tensor


def _rank_main(rank, world, port, target, params, out_queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from torchtitan.tools import storage
    from torchtitan.components.checkpoint import checksums

    n = int(params) // TENSOR
    gen = torch.Generator().manual_seed(rank)
    state = {f"w{i}": torch.randn(TENSOR, generator=gen) for i in range(n) if i % world == rank}
    pg = dist.new_group(backend="gloo")
    times = {}

    def timed(name, fn):
        dist.barrier()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        times[name] = time.perf_counter() - t0
        return result

    def clear(path):
        if rank == 0:
            storage.remove_tree(path)
        dist.barrier()

    sync_path, async_path = storage.join(target, "sync"), storage.join(target, "async")
    clear(sync_path)
    timed("save", lambda: dcp.save({"m": state}, checkpoint_id=sync_path,
                                   storage_writer=checksums.ChecksummingWriter(sync_path, rank)))
    clear(async_path)
    dist.barrier()
    t0 = time.perf_counter()
    future = dcp.async_save({"m": state}, checkpoint_id=async_path,
                            storage_writer=checksums.ChecksummingWriter(async_path, rank), process_group=pg)
    blocking = time.perf_counter() - t0
    future.result()
    dist.barrier()
    times["async_total"] = time.perf_counter() - t0
    times["async_blocking"] = torch.tensor(blocking)
    dist.all_reduce(times["async_blocking"], op=dist.ReduceOp.MAX)
    times["async_blocking"] = times["async_blocking"].item()
    fresh = {"m": {k: torch.empty_like(v) for k, v in state.items()}}
    timed("load", lambda: dcp.load(fresh, checkpoint_id=sync_path, storage_reader=storage.dcp_reader(sync_path)))
    assert all(torch.equal(fresh["m"][k], v) for k, v in state.items())
    clear(sync_path)
    clear(async_path)
    if rank == 0:
        out_queue.put(times)
    dist.destroy_process_group()


def trial(world, target, params):
    from tests.s3_server import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, target, params, q)) for r in range(world)]
    for p in procs:
        p.start()
    times = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=120)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank failed (exit {p.exitcode})")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    from tests.s3_server import S3Server, environment, make_bucket

    server = S3Server()
    os.environ.update(environment(server.endpoint))
    make_bucket(server.endpoint, "bench")
    local = tempfile.mkdtemp(prefix="storage-bench-")
    mb = int(args.params) // TENSOR * TENSOR * 4 / 1e6
    try:
        print(f"# {mb:.0f} MB of fp32 state; CPU: {_cpu()}; torch {torch.__version__}; OMP_NUM_THREADS=1 per rank")
        print("| ranks | storage | save s | save MB/s | async blocking s | async total s | load s | load MB/s |")
        print("|---|---|---|---|---|---|---|---|")
        for world in map(int, args.worlds.split(",")):
            runs = {"local": [], "s3": []}
            for _ in range(args.repeats):
                for kind, target in (("local", local), ("s3", "s3://bench/ckpt")):  # alternated
                    runs[kind].append(trial(world, target, args.params))
            for kind, results in runs.items():
                med = {k: statistics.median(r[k] for r in results) for k in results[0]}
                print(f"| {world} | {kind} | {med['save']:.2f} | {mb / med['save']:.0f} | "
                      f"{med['async_blocking']:.2f} | {med['async_total']:.2f} | {med['load']:.2f} | "
                      f"{mb / med['load']:.0f} |", flush=True)
    finally:
        server.stop()
        shutil.rmtree(local, ignore_errors=True)
    return 0


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
