"""Build the shipped SFT data set ``torchtitan/assets/stdlib_sft/qa.jsonl.gz`` from the shipped corpus.

Usage::

    python scripts/data/build_sft_data.py [--corpus DIR] [--out FILE]

Each paragraph of a stdlib_docs document that reads like a docstring (a summary line of 15-120 characters
followed by at least 40 characters of explanation) becomes one question/answer record:

    {"prompt": "What does the Python documentation say about: <summary line>", "completion": "<explanation>"}

Held-out split: the `chat` dataset reads every 100th line (0, 100, 200, ...) as validation, so those lines are
filled with records made from the corpus's *validation* documents (leaving out answers that also occur in
the train documents: some docstrings repeat across modules) and every other line with records from its train
documents. A validation answer is therefore text the model never trained on, not just an unseen line. The file is deterministic for a given corpus.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "torchtitan" / "assets" / "stdlib_docs"
OUT = ROOT / "torchtitan" / "assets" / "stdlib_sft" / "qa.jsonl.gz"
EVERY = 100  # sources.HOLDOUT_EVERY: the chat dataset's validation lines
MAX_VALIDATION = 30  # 30 held-out records, 2970 train records: the file stays well under 1 MB
MAX_ANSWER = 300


def qa_records(doc: str) -> Iterator[dict]:
    for paragraph in doc.split("\n\n"):
        lines = [line.strip() for line in paragraph.strip().splitlines() if line.strip()]
        if len(lines) < 2:
            continue
        summary, body = lines[0], " ".join(lines[1:])
        if not 15 <= len(summary) <= 120 or len(body) < 40:
            continue
        answer = body[:MAX_ANSWER].rsplit(" ", 1)[0] if len(body) > MAX_ANSWER else body
        yield {"prompt": f"What does the Python documentation say about: {summary}", "completion": answer}


def _records(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [r for line in f for r in qa_records(json.loads(line)["text"])]


def build(corpus: Path, out: Path) -> tuple[int, int]:
    train, validation = _records(corpus / "train.jsonl.gz"), _records(corpus / "validation.jsonl.gz")
    seen = {r["completion"] for r in train}
    validation = [r for r in validation if r["completion"] not in seen]  # docstrings repeated across modules
    n_val = min(MAX_VALIDATION, len(validation), len(train) // (EVERY - 1))
    validation = validation[:: max(1, len(validation) // n_val)][:n_val]  # spread over the held-out documents
    stride = max(1, len(train) // (n_val * (EVERY - 1)))
    train = train[::stride][: n_val * (EVERY - 1)]  # spread over the train documents
    lines, t = [], iter(train)
    for i in range(n_val * EVERY):
        lines.append(validation[i // EVERY] if i % EVERY == 0 else next(t))
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(out, "wb", mtime=0) as f:  # mtime 0: the same bytes on every rebuild
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines).encode())
    return len(train), len(validation)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    n_train, n_val = build(args.corpus, args.out)
    print(f"wrote {args.out}: {n_train} train and {n_val} held-out records ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
