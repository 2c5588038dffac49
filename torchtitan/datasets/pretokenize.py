"""Tokenize a dataset once into memory-mapped shards (format: shards.py).

    python -m torchtitan.datasets.pretokenize --dataset local --dataset_path 'data/*.jsonl' \\
        --output /data/shards/mydata --split train --workers 8

Any dataset the trainer reads works (`stdlib_docs`, `local` files, `c4` / `fineweb` from the hub or a
local copy via --dataset_path). Documents are read in order once and cut into parts of --docs_per_part
documents; part i holds documents [i*N, (i+1)*N) and is tokenized and written by one of --workers
processes, so parts are tokenized in parallel, and a rerun of the same command skips the parts already
complete (resumable). The manifest is written last.
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

from torchtitan.components.tokenizer.backends import build_tokenizer
from torchtitan.datasets.chat import tokenize_document
from torchtitan.datasets.shards import (
    FORMAT,
    MANIFEST,
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


def _tokenize_part(tokenizer_path: str | None, folder: str, index: int, docs: list) -> dict:
    tokenizer = _worker_tokenizer(tokenizer_path)
    tokens = [tokenize_document(doc, tokenizer)[0] for doc in docs]
    return write_part(Path(folder), index, tokens, token_dtype(tokenizer.vocab_size))


_TOKENIZERS: dict = {}


def _worker_tokenizer(path: str | None):
    if path not in _TOKENIZERS:  # once per worker process
        _TOKENIZERS[path] = build_tokenizer(path)
    return _TOKENIZERS[path]


def pretokenize(args: argparse.Namespace) -> dict:
    """Reads the documents in order in this process (any source, a hub stream included, is read once) and
    hands each part's documents to a worker that tokenizes and writes it; at most 2 x workers parts wait."""
    tokenizer = build_tokenizer(args.tokenizer)
    source = open_documents(args.dataset, args.dataset_path, args.split)
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
    done: dict[int, dict] = {}
    first = 0
    while (meta := read_part_meta(folder, first)) is not None and meta["num_docs"] == n:
        done[first] = meta  # complete parts of an earlier run: resume after them without reading them
        first += 1
    docs = source.iter_from(first * n)
    if args.max_docs is not None:
        docs = itertools.islice(docs, max(args.max_docs - first * n, 0))
    bar = tqdm(total=args.max_docs, initial=first * n, unit="doc", file=sys.stderr,
               desc=f"pretokenize {args.dataset}/{args.split}")
    ctx = multiprocessing.get_context("spawn")  # no forked copies of torch / tokenizer threads
    in_flight: dict = {}
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        index = first
        while True:
            part = list(itertools.islice(docs, n))
            meta = read_part_meta(folder, index)
            if meta is not None and meta["num_docs"] == len(part):
                done[index] = meta  # written by an earlier run
                bar.update(len(part))
            elif part or index == 0:
                in_flight[pool.submit(_tokenize_part, args.tokenizer, str(folder), index, part)] = len(part)
            while in_flight and (len(in_flight) >= 2 * args.workers or len(part) < n):
                finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for fut in finished:
                    bar.update(in_flight.pop(fut))
                    meta = fut.result()
                    done[int(meta["name"].split("-")[1])] = meta
            if len(part) < n:
                break
            index += 1
    bar.close()
    parts = [done[i] for i in sorted(done)]
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
