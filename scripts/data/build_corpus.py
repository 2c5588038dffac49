"""Build the shipped ``stdlib_docs`` corpus from the Python standard library's docstrings.

Usage::

    python scripts/data/build_corpus.py [--stdlib DIR] [--out DIR]

Each stdlib module becomes one document: its module, class and function docstrings, in
source order, joined with blank lines. Files are parsed with ``ast`` (never imported), so
building the corpus runs no stdlib code. The output files in ``torchtitan/assets/stdlib_docs``
are what every machine trains on; this script only records how they were produced (their
exact content depends on the Python version that ran it).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Directories that are either tests, vendored third-party code, GUI/demo code, or
# machine-generated tables: their docstrings are repetitive noise rather than prose.
SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "tkinter",
        "turtledemo",
        "lib2to3",
        "site-packages",
        "dist-packages",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "config-3",
    }
)
# Single modules that are stubs without prose.
SKIP_FILES = frozenset({"__phello__.foo.py"})

VALIDATION_EVERY = 25  # document i goes to validation when i % VALIDATION_EVERY == 0
MIN_DOC_CHARS = 200  # shorter documents carry almost no text to learn from


def iter_source_files(stdlib: Path) -> Iterator[Path]:
    """Yield stdlib ``.py`` files in a fixed (sorted relative path) order."""
    for path in sorted(stdlib.rglob("*.py"), key=lambda p: p.relative_to(stdlib).as_posix()):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS or part.startswith("config-3") for part in rel.parts[:-1]):
            continue
        if rel.name in SKIP_FILES or rel.name.startswith("test_"):
            continue
        yield path


def iter_docstrings(node: ast.AST) -> Iterator[str]:
    """Yield the docstrings of ``node`` and every nested class/function, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        # clean=True applies inspect.cleandoc: strips the common indentation.
        doc = ast.get_docstring(node, clean=True)
        if doc and doc.strip():
            yield doc.strip()
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from iter_docstrings(child)


def module_document(path: Path) -> str | None:
    """Return one module's document, or ``None`` if it does not parse or is too short."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return None
    text = "\n\n".join(iter_docstrings(tree))
    return text if len(text) >= MIN_DOC_CHARS else None


def write_jsonl_gz(path: Path, texts: list[str]) -> None:
    """Write texts as gzip'd JSON lines; mtime=0 and no embedded file name keep bytes reproducible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for text in texts:
            gz.write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode("utf-8"))


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    parser.add_argument("--out", type=Path, default=repo / "torchtitan" / "assets" / "stdlib_docs")
    args = parser.parse_args()

    docs = [d for d in (module_document(p) for p in iter_source_files(args.stdlib)) if d is not None]
    train = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY != 0]
    validation = [d for i, d in enumerate(docs) if i % VALIDATION_EVERY == 0]
    write_jsonl_gz(args.out / "train.jsonl.gz", train)
    write_jsonl_gz(args.out / "validation.jsonl.gz", validation)
    for name, split in (("train", train), ("validation", validation)):
        size = (args.out / f"{name}.jsonl.gz").stat().st_size
        chars = sum(len(d) for d in split)
        print(f"{name}: {len(split)} documents, {chars:,} characters, {size:,} bytes compressed")


if __name__ == "__main__":
    main()
