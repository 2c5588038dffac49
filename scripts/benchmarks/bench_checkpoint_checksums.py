"""What the checkpoint content checksums cost: save time and write throughput with and without them, one run.

    python scripts/benchmarks/bench_checkpoint_checksums.py [--mb 256] [--repeats 5] [--folder /tmp/ckpt-crc-bench]

A state of `mb` MiB of fp32 tensors (a model-like mix: a few large matrices, many small vectors) is saved by
DCP in one process, alternately with the plain FileSystemWriter and with ChecksummingWriter (CRC-32 of every
byte as it is written, components/checkpoint/checksums.py); the medians, min/max and their ratio are printed,
with the bare CRC-32 rate of this CPU and the cost of verifying at load (one read of every file). The page
cache is warm: the figures bound the CPU cost of the hash, not a disk's speed.
"""

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import warnings  # noqa: E402

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.filesystem import FileSystemWriter  # noqa: E402

from torchtitan.components.checkpoint.checksums import ChecksummingWriter, file_checksum  # noqa: E402

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def state(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = mb * (1 << 20) // 4
    big = [torch.randn(n // 8, generator=g) for _ in range(6)]  # 3/4 in six matrices
    rest = n - sum(t.numel() for t in big)
    small = [torch.randn(rest // 200, generator=g) for _ in range(200)]  # norms, biases
    return {f"w{i}": t for i, t in enumerate(big + small)}


def save(sd: dict, folder: str, checksummed: bool) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    writer = ChecksummingWriter(folder, rank=0) if checksummed else FileSystemWriter(folder)
    t0 = time.perf_counter()
    dcp.save(sd, storage_writer=writer, no_dist=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--folder", default="/tmp/ckpt-crc-bench")
    args = parser.parse_args()
    sd = state(args.mb)
    folder = os.path.join(args.folder, "ckpt")
    save(sd, folder, False), save(sd, folder, True)  # warm-up: allocator, page cache, imports
    times = {False: [], True: []}
    for _ in range(args.repeats):  # alternate A and B
        for checksummed in (False, True):
            times[checksummed].append(save(sd, folder, checksummed))
    blob = os.urandom(64 << 20)
    t0 = time.perf_counter()
    zlib.crc32(blob)
    crc_rate = len(blob) / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for name in os.listdir(folder):
        file_checksum(os.path.join(folder, name))
    verify_s = time.perf_counter() - t0
    shutil.rmtree(args.folder, ignore_errors=True)
    mib = args.mb
    plain, crc = statistics.median(times[False]), statistics.median(times[True])
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores visible, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; state {mib} MiB fp32, {args.repeats} saves each, alternating")
    print("| writer | save s (median) | min-max | MiB/s |")
    print("|---|---|---|---|")
    for label, key in (("FileSystemWriter", False), ("ChecksummingWriter (CRC-32)", True)):
        t = times[key]
        print(f"| {label} | {statistics.median(t):.3f} | {min(t):.3f}-{max(t):.3f} | {mib / statistics.median(t):.0f} |")
    print(f"save time ratio checksummed/plain: {crc / plain:.3f} (throughput ratio {plain / crc:.3f})")
    print(f"bare zlib.crc32: {crc_rate / 2**30:.2f} GiB/s; verify at load (read + CRC every file): {verify_s:.3f} s "
          f"= {mib / verify_s:.0f} MiB/s")


if __name__ == "__main__":
    main()
