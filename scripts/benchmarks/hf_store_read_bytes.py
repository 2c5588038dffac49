"""Bytes and requests one rank spends reading its share of a Hugging Face folder on an S3 server (moto on
loopback), through the reader the trainer uses (hf_folder.SliceReader on a URL: ranged GETs of each box).

    python scripts/benchmarks/hf_store_read_bytes.py [--flavor debugmodel] [--ranks 4]

The folder is the flavor's model in bf16. Each rank reads the boxes it would hold with every tensor split over
`ranks` along dim 0 (FSDP's shards) and then along dim 1 (tensor parallel's row-wise split, the worst case for
an object store, which has no strided reads: rows closer than MERGE_GAP_BYTES are fetched whole). A row gives
what the rank needs, what it fetched, in how many GETs, and the seconds (moto is a pure-Python server on this
machine's cores: the seconds are a floor, the bytes and request counts are what a real store would see).
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.s3_server import S3Server, environment, make_bucket  # noqa: E402
from torchtitan.components.checkpoint import hf_folder  # noqa: E402
from torchtitan.components.checkpoint.offline_model import build_cpu_model  # noqa: E402
from torchtitan.protocols.train_spec import config_manager  # noqa: E402
from torchtitan.tools import storage  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--ranks", type=int, default=4)
    args = p.parse_args()
    server = S3Server()
    os.environ.update(environment(server.endpoint))
    try:
        make_bucket(server.endpoint, "bench-hf")
        model, spec, _, model_args = build_cpu_model(config_manager().parse_args(["--model.flavor", args.flavor]))
        local = os.path.join(tempfile.mkdtemp(), "hf")
        hf_folder.save_hf_folder(model.state_dict(), spec.state_dict_adapter, model_args, local, dtype=torch.bfloat16)
        url = "s3://bench-hf/hf"
        hf_folder.upload_files(local, url)
        folder_bytes = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local) if f.endswith(".safetensors"))
        counted = {"bytes": 0, "gets": 0}
        read_ranges = storage.read_ranges

        def counting(path, ranges):
            counted["bytes"] += sum(b - a for a, b in ranges)
            counted["gets"] += len(ranges)
            return read_ranges(path, ranges)

        storage.read_ranges = counting
        reader = hf_folder.SliceReader(url)
        print(f"{args.flavor}, bf16 safetensors {folder_bytes / 2**20:.2f} MiB, {args.ranks} ranks")
        for dim, name in ((0, "dim-0 (FSDP)"), (1, "dim-1 (TP row-wise)")):
            for rank in range(args.ranks):
                counted.update(bytes=0, gets=0)
                need, t0 = 0, time.perf_counter()
                for key in sorted(reader.where):
                    shape = reader.shape(key)
                    d = dim if len(shape) > dim else 0
                    lo, hi = rank * shape[d] // args.ranks, (rank + 1) * shape[d] // args.ranks
                    if hi > lo:
                        offsets, sizes = [0] * len(shape), list(shape)
                        offsets[d], sizes[d] = lo, hi - lo
                        t = reader.read(key, offsets, sizes)
                        need += t.numel() * t.element_size()
                print(f"{name:20s} rank {rank}: needs {need / 2**20:6.2f} MiB, fetched {counted['bytes'] / 2**20:6.2f} "
                      f"MiB in {counted['gets']} GETs, {time.perf_counter() - t0:.2f}s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
