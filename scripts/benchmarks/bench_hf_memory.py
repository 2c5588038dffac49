"""Peak host memory (RSS high-water mark, measured) of Hugging Face folder I/O per rank, on CPU with gloo.

    python scripts/benchmarks/bench_hf_memory.py [--dim 1024 --layers 17] [--folder /tmp/hf-mem-bench]

A Llama of 205M parameters is written once as a bf16 HF folder (2 safetensors shards + index). Then, per
phase, in fresh processes:
  load N   N FSDP ranks (N = 1, 2, 4) each build their fp32 shard of the model and fill it from the folder
           (components/hf_folder.load_hf_into: each rank reads only its slices);
  save 4   4 FSDP ranks write the sharded model as an HF folder (save_hf_folder: parts + DCP consolidation);
  convert  scripts/checkpoints/convert_to_hf.py's streaming conversion of a DCP checkpoint of the model, one process.
Each row gives the rank's RSS before the phase without the model ("base": imports, process group), what
its fp32 model shard adds, its peak during the phase (/proc VmHWM, reset by clear_refs), and the bound
  load/save: base + 1/N of the fp32 model + the largest tensor + C;   convert: base + 3 x largest + C,
with C = the 64 MB write buffer (hf_folder.PART_BYTES) + 64 MB. Loading keeps no file mapped between reads.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from tests.multiprocess import run_ranks  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import PART_BYTES  # noqa: E402

CONSTANT_MB = PART_BYTES // 2**20 + 64  # the write buffer + 64 MB of allocator and Python slack


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def peak_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def model_args(a):
    from torchtitan.models.llama3.args import TransformerModelArgs

    return TransformerModelArgs(dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64, n_kv_heads=a.dim // 128,
                                vocab_size=a.vocab, ffn_hidden_dim=int(2.75 * a.dim), max_seq_len=2048)


def _sharded_model(args, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchtitan.models.llama3.model import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # touch the shard's pages, so "before" holds them
    return model


def _load(rank, world_size, args, folder):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from torchtitan.components.checkpoint.hf_folder import load_hf_into
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    base = rss_mb()
    model = _sharded_model(args, world_size)
    state = get_model_state_dict(model)
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    load_hf_into(state, folder, Llama3StateDictAdapter(args))
    return base, before, peak_mb(), time.perf_counter() - t0


def _save(rank, world_size, args, folder, out):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from torchtitan.components.checkpoint.hf_folder import load_hf_into, save_hf_folder
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    base = rss_mb()
    model = _sharded_model(args, world_size)
    load_hf_into(get_model_state_dict(model), folder, Llama3StateDictAdapter(args))
    dist.barrier()
    before = rss_mb()
    reset_peak()
    t0 = time.perf_counter()
    save_hf_folder(get_model_state_dict(model), Llama3StateDictAdapter, args, out, dtype=torch.bfloat16,
                   max_shard_bytes=300 * 10**6)
    return base, before, peak_mb(), time.perf_counter() - t0


CONVERT = """
import sys, time
sys.path.insert(0, {root!r}); sys.path[:0] = [{root!r} + "/scripts/benchmarks", {root!r} + "/scripts/checkpoints"]
from bench_hf_memory import rss_mb, reset_peak, peak_mb
import convert_to_hf, torch
before = rss_mb(); reset_peak(); t0 = time.perf_counter()
convert_to_hf.convert({dcp!r}, {out!r}, torch.bfloat16, 300 * 10**6, {overrides!r})
print(before, before, peak_mb(), time.perf_counter() - t0)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=17)
    p.add_argument("--vocab", type=int, default=2048, help="the shipped tokenizer's, which conversion resizes to")
    p.add_argument("--folder", default="/tmp/hf-mem-bench")
    a = p.parse_args()
    from torchtitan.components.checkpoint.manager import write_model_checkpoint
    from torchtitan.components.checkpoint.hf_folder import save_hf_folder
    from torchtitan.protocols.model_shape import flatten_args
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    args = model_args(a)
    shutil.rmtree(a.folder, ignore_errors=True)
    hf = os.path.join(a.folder, "hf")
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters()) * 4  # fp32 in the model
    save_hf_folder(model.state_dict(), Llama3StateDictAdapter, args, hf, dtype=torch.bfloat16, max_shard_bytes=300 * 10**6)
    write_model_checkpoint(os.path.join(a.folder, "dcp"), model.state_dict(), None, {"step": 0})
    del model
    file_mb = n_params * 2 / 2**20
    print(f"Llama {n_params / 1e6:.0f}M parameters: {file_mb:.0f} MB in bf16 ({sum(f.endswith('.safetensors') for f in os.listdir(hf))} safetensors "
          f"files), fp32 model {n_params * 4 / 2**20:.0f} MB, largest tensor {largest / 2**20:.0f} MB (fp32)")
    print(f"CPU: {cpu_name()}, torch {torch.__version__}\n")
    model_mb, largest_mb = n_params * 4 / 2**20, largest / 2**20
    print(f"bound of peak - base: load/save model_fp32/N + largest + C, convert 3 x largest + C; C = {CONSTANT_MB} MB\n")
    print("| phase | rank | base (MB) | + shard (MB) | peak (MB) | peak - base (MB) | bound (MB) | within | time (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in (1, 2, 4):
        rows = run_ranks(_load, n, args, hf)
        _report("load", n, rows, model_mb / n + largest_mb + CONSTANT_MB)
    out = os.path.join(a.folder, "hf_out")
    rows = run_ranks(_save, 4, args, hf, out)
    _report("save", 4, rows, model_mb / 4 + largest_mb + CONSTANT_MB)
    overrides = ["--model.overrides", ",".join(flatten_args(args))]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = CONVERT.format(root=root, dcp=os.path.join(a.folder, "dcp"), out=os.path.join(a.folder, "converted"),
                          overrides=overrides)
    line = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    _report("convert", 1, [tuple(map(float, line[-4:]))], 3 * largest_mb + CONSTANT_MB)
    shutil.rmtree(a.folder, ignore_errors=True)


def _report(phase, n, rows, bound):
    for rank, (base, before, peak, seconds) in enumerate(rows):
        extra = peak - base
        print(f"| {phase} | {rank + 1}/{n} | {base:.0f} | {before - base:.0f} | {peak:.0f} | {extra:.0f} | {bound:.0f} | "
              f"{'yes' if extra <= bound else 'NO'} | {seconds:.1f} |")


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = "unknown CPU"
    return f"{name}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
