"""Data loading: tokens/s the loader delivers per rank from pre-tokenized shards vs. raw text, and the
share of a DP 4 training run spent waiting for data (`data_loading_pct`) with each.

1. Pre-tokenizes the shipped stdlib_docs train split into a temporary shard folder (timed).
2. Loader: data-parallel rank 0 of --dp iterates its microbatches for --steps global batches, from raw
   text (every rank tokenizes every window of the global batch) and from shards (a rank reads only its
   own windows by memory map); rounds alternate, medians. Tokens/s = tokens delivered to this rank / s.
3. Training: FSDP --dp through torchrun (`-m torchtitan.train`, --flavor, seq --seq-len, local batch
   global/dp), from raw text and from shards; median data_loading_pct of logged steps 3..N.

    python scripts/benchmarks/bench_data.py [--seq-len 512] [--global-batch 32] [--dp 4] [--steps 20] [--train-steps 12]
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loader_tokens_per_s(dataset: str, args) -> float:
    from torchtitan.components.tokenizer.backends import build_tokenizer
    from torchtitan.config import ConfigManager
    from torchtitan.datasets.dataloader import build_text_dataloader

    cfg = ConfigManager().parse_args(["--training.dataset", dataset, "--training.seq_len", str(args.seq_len)])
    local = args.global_batch // args.dp
    loader = build_text_dataloader(tokenizer=build_tokenizer(None), job_config=cfg, split="train", dp_rank=0,
                                   dp_degree=args.dp, global_batch_size=args.global_batch, local_batch_size=local,
                                   infinite=True)
    it = iter(loader)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        next(it)
    return args.steps * local * args.seq_len / (time.perf_counter() - t0)


def train_data_pct(dataset: str, args) -> dict:
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.dp}",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "torchtitan.train",
               "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
               "--training.local_batch_size", str(args.global_batch // args.dp),
               "--parallelism.data_parallel_shard_degree", str(args.dp), "--training.steps", str(args.train_steps),
               "--metrics.log_freq", "1", "--training.dataset", dataset, "--job.dump_folder", dump]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"training from {dataset} failed: {(p.stderr or p.stdout).strip().splitlines()[-1]}")
        steps = [json.loads(x) for x in Path(dump, "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in steps if "data_loading_pct" in m and m["step"] > 2]
    return {"data_loading_pct": statistics.median(m["data_loading_pct"] for m in steps),
            "tps_per_device": statistics.median(m["tps"] for m in steps)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="global batches per loader measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--train-steps", type=int, default=12)
    args = p.parse_args()

    from torchtitan.datasets.pretokenize import main as pretokenize

    with tempfile.TemporaryDirectory() as tmp:
        shards = str(Path(tmp) / "stdlib_docs")
        t0 = time.perf_counter()
        assert pretokenize(["--output", shards, "--workers", "2", "--docs_per_part", "50"]) == 0
        pretok_s = time.perf_counter() - t0
        manifest = json.loads((Path(shards) / "train" / "manifest.json").read_text())
        print(f"pretokenize: {manifest['num_docs']} docs, {manifest['num_tokens']:,} tokens in {pretok_s:.1f} s "
              f"(2 workers, incl. process start) = {manifest['num_tokens'] / pretok_s:,.0f} tokens/s")

        speeds: dict[str, list[float]] = {"raw text": [], "shards": []}
        for _ in range(args.rounds):
            speeds["raw text"].append(loader_tokens_per_s("stdlib_docs", args))
            speeds["shards"].append(loader_tokens_per_s(shards, args))
        med = {k: statistics.median(v) for k, v in speeds.items()}
        print(f"loader, rank 0 of DP {args.dp}, global batch {args.global_batch} x seq {args.seq_len}:")
        for k, v in speeds.items():
            print(f"  {k:8s}: {med[k]:>12,.0f} tokens/s per rank  (rounds: {', '.join(f'{x:,.0f}' for x in v)})")
        print(f"  shards / raw text: {med['shards'] / med['raw text']:.1f}x")

        print(f"training, FSDP {args.dp} ({args.flavor}, local batch {args.global_batch // args.dp} x seq {args.seq_len}):")
        for name, dataset in (("raw text", "stdlib_docs"), ("shards", shards)):
            r = train_data_pct(dataset, args)
            print(f"  {name:8s}: data_loading_pct {r['data_loading_pct']:.2f}%  tok/s/device {r['tps_per_device']:,.0f}")


if __name__ == "__main__":
    main()
