"""Tokenize a dataset once into memory-mapped shards (format: shards.py).

    python -m torchtitan.datasets.pretokenize --dataset local --dataset_path 'data/*.jsonl' \\
        --output /data/shards/mydata --split train --workers 8

Any dataset the trainer reads works (`stdlib_docs`, `local` files, `c4` / `fineweb` from the hub or a
local copy via --dataset_path). Documents are cut into parts of --docs_per_part documents; part i holds
documents [i*N, (i+1)*N) and is tokenized by one worker process, so parts are written in parallel and a
rerun of the same command skips the parts already complete (resumable). The manifest is written last.
Train from it with `--training.dataset /data/shards/mydata` (or as a `--training.datasets` entry).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

from tqdm import tqdm

from torchtitan.components.tokenizer import build_tokenizer
from torchtitan.datasets.chat import tokenize_document
from torchtitan.datasets.shards import (
    FORMAT,
    MANIFEST,
    part_name,
    read_part_meta,
    token_dtype,
    tokenizer_fingerprint,
    write_part,
)
from torchtitan.datasets.sources import DATASETS, SPLITS, open_documents


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torchtitan.datasets.pretokenize", description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="stdlib_docs", choices=sorted(n for n in DATASETS if n != "chat"),
                   help="dataset name, as --training.dataset")
    p.add_argument("--dataset_path", default=None, help="local files / copy, as --training.dataset_path")
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("--tokenizer", default=None, help="tokenizer file or folder, as --model.tokenizer_path "
                   "(default: the shipped one)")
    p.add_argument("--output", required=True, help="shard folder; this split goes to OUTPUT/<split>/")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    p.add_argument("--docs_per_part", type=int, default=10_000, help="documents per shard part")
    p.add_argument("--max_docs", type=int, default=None, help="stop after this many documents (e.g. of a hub stream)")
    return p.parse_args(argv)


def _tokenize_part(dataset: str, dataset_path: str | None, split: str, tokenizer_path: str | None,
                   folder: str, index: int, count: int) -> dict:
    tokenizer = build_tokenizer(tokenizer_path)
    source = open_documents(dataset, dataset_path, split)
    docs = []
    for doc in itertools.islice(source.iter_from(index * count), count):
        tokens, _ = tokenize_document(doc, tokenizer)
        docs.append(tokens)
    return write_part(Path(folder), index, docs, token_dtype(tokenizer.vocab_size))


def pretokenize(args: argparse.Namespace) -> dict:
    tokenizer = build_tokenizer(args.tokenizer)
    open_documents(args.dataset, args.dataset_path, args.split)  # fail fast on a bad dataset / path
    folder = Path(args.output) / args.split
    folder.mkdir(parents=True, exist_ok=True)
    job = {
        "format": FORMAT,
        "source": {"dataset": args.dataset, "dataset_path": args.dataset_path, "split": args.split},
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "dtype": token_dtype(tokenizer.vocab_size).str,
        "docs_per_part": args.docs_per_part,
        "max_docs": args.max_docs,
    }
    job_file = folder / "job.json"
    if job_file.is_file() and json.loads(job_file.read_text()) != job:
        raise ValueError(f"{folder} holds parts written with other settings ({job_file}); use a new --output")
    job_file.write_text(json.dumps(job, indent=1))

    n = args.docs_per_part
    max_parts = None if args.max_docs is None else -(-args.max_docs // n)
    done: dict[int, dict] = {}
    last: int | None = None  # index of the first part with fewer than n documents: the end of the data
    bar = tqdm(total=args.max_docs, unit="doc", desc=f"pretokenize {args.dataset}/{args.split}", file=sys.stderr)
    in_flight: dict = {}
    next_part = 0

    def finish(i: int, meta: dict) -> None:
        nonlocal last
        done[i] = meta
        bar.update(meta["num_docs"])
        if meta["num_docs"] < n:
            last = i if last is None else min(last, i)

    ctx = multiprocessing.get_context("spawn")  # no forked copies of torch / tokenizer threads
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        while True:
            while len(in_flight) < args.workers and (last is None or next_part <= last) and (
                max_parts is None or next_part < max_parts
            ):
                count = n if args.max_docs is None else min(n, args.max_docs - next_part * n)
                meta = read_part_meta(folder, next_part)
                if meta is not None:  # written by an earlier run: resume past it
                    finish(next_part, meta)
                else:
                    fut = pool.submit(_tokenize_part, args.dataset, args.dataset_path, args.split, args.tokenizer,
                                      str(folder), next_part, count)
                    in_flight[fut] = next_part
                next_part += 1
            if not in_flight:
                break
            completed, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for fut in completed:
                finish(in_flight.pop(fut), fut.result())
    bar.close()
    end = last if last is not None else max(done)
    for i in [i for i in done if i > end]:  # parts speculatively started past the end hold no documents
        for suffix in (".tokens", ".docs", ".json"):
            (folder / f"{part_name(i)}{suffix}").unlink(missing_ok=True)
    parts = [done[i] for i in range(end + 1)]
    manifest = {
        **job,
        "name": Path(args.output).name,
        "parts": parts,
        "num_docs": sum(p["num_docs"] for p in parts),
        "num_tokens": sum(p["num_tokens"] for p in parts),
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        m = pretokenize(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {m['num_docs']:,} documents, {m['num_tokens']:,} tokens in {len(m['parts'])} part(s) "
          f"to {Path(args.output) / args.split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
