"""Build the shipped evaluation task `stdlib_next_line` from the held-out split of the shipped corpus.

    python scripts/data/build_eval_task.py [--docs 100] [--seed 0]

Each document is a line of a docstring paragraph from torchtitan/assets/stdlib_docs/validation.jsonl.gz (the
split the training never reads) and four candidate next lines: the true one and the next lines of three other
paragraphs, in a seeded order. A model that learned the corpus's prose picks the true line more often than
one in four. Written as lm-evaluation-harness task files (a YAML and its JSON-lines data beside it), so the
harness itself can score the same task (tests/unit/test_eval_harness_parity.py does).
"""

import argparse
import gzip
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "torchtitan" / "assets" / "stdlib_docs" / "validation.jsonl.gz"
OUT = ROOT / "torchtitan" / "assets" / "eval_tasks"

YAML = """\
# Shipped with torchtitan: which of four lines follows a docstring line (held-out stdlib_docs split).
# Built by scripts/data/build_eval_task.py; lm-evaluation-harness reads this file as it is.
task: stdlib_next_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: stdlib_next_line.jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "{{line}}\\n"
doc_to_target: label
doc_to_choice: choices
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def line_pairs(texts: list[str]) -> list[tuple[str, str]]:
    """(line, next line) of every paragraph with two prose lines of 20-80 characters."""
    pairs = []
    for text in texts:
        for para in text.split("\n\n"):
            lines = [ln.strip() for ln in para.splitlines()]
            if len(lines) >= 2 and all(20 <= len(ln) <= 80 for ln in lines[:2]) and lines[0] != lines[1]:
                pairs.append((lines[0], lines[1]))
    return pairs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    pairs = line_pairs(texts)
    rnd = random.Random(args.seed)
    picked = rnd.sample(range(len(pairs)), args.docs)
    with open(OUT / "stdlib_next_line.jsonl", "w", encoding="utf-8") as f:
        for i in picked:
            line, answer = pairs[i]
            others = [pairs[j][1] for j in rnd.sample(range(len(pairs)), 8) if j != i and pairs[j][1] != answer]
            choices = [answer, *others[:3]]
            rnd.shuffle(choices)
            f.write(json.dumps({"line": line, "choices": choices, "label": choices.index(answer)}) + "\n")
    (OUT / "stdlib_next_line.yaml").write_text(YAML)
    print(f"{args.docs} documents from {len(pairs)} line pairs -> {OUT}")


if __name__ == "__main__":
    main()
