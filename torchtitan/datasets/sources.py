"""Document sources: where training and validation texts come from, in a fixed order.

A source yields raw document texts; tokenisation and packing happen downstream. Every
source can restart at any document index, which is what checkpoint resumption needs.

Datasets:

- ``stdlib_docs`` (default): the corpus shipped in ``torchtitan/assets/stdlib_docs``.
- ``c4``, ``fineweb``: streamed from the Hugging Face hub (or a local copy at ``dataset_path``).
- ``local``: json / jsonl / parquet / txt files (optionally ``.gz``) at ``dataset_path``.
- ``chat``: a jsonl(.gz) file of chat / instruction records at ``dataset_path`` (SFT, see chat.py); its
  documents are records (dicts), not texts.

Where a dataset has no validation split, every ``HOLDOUT_EVERY``-th document (index 0, 100,
200, ...) is validation and the rest is train, so the two never overlap.
"""

from __future__ import annotations

import difflib
import glob
import gzip
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Split = Literal["train", "validation"]
SPLITS: tuple[Split, ...] = ("train", "validation")

STDLIB_DOCS_DIR = Path(__file__).resolve().parent.parent / "assets" / "stdlib_docs"
HOLDOUT_EVERY = 100
TEXT_FIELD = "text"
# File suffix (after dropping a trailing .gz) -> datasets builder name.
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


class DataSourceError(RuntimeError):
    """A document source kept failing while reading, past its retry budget (the message names it). Restarting
    the run can help (the stream or the file may be back), so the supervisor restarts it."""


class DocumentSource(ABC):
    """Documents (texts, or chat records for ``chat``) in a fixed order; ``iter_from(n)`` starts at document
    ``n`` (0-based)."""

    name: str
    # True when iter_from(n) is exact and does not re-read the documents before n as text.
    resumable: bool

    @abstractmethod
    def iter_from(self, doc_index: int) -> Iterator[Any]: ...


def holdout_start(doc_index: int, split: Split, every: int = HOLDOUT_EVERY) -> int:
    """Underlying index of the ``doc_index``-th document of ``split`` under the hold-out rule
    (validation = underlying indices 0, every, 2*every, ...; train = all others)."""
    if split == "validation":
        return doc_index * every
    # Train skips one index per block of `every`: blocks hold every-1 train documents.
    return doc_index + doc_index // (every - 1) + 1


def in_split(underlying_index: int, split: Split, every: int = HOLDOUT_EVERY) -> bool:
    return (underlying_index % every == 0) == (split == "validation")


class JsonlGzSource(DocumentSource):
    """One gzip'd JSON-lines file, one ``{"text": ...}`` object per line."""

    resumable = True

    def __init__(self, name: str, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(
                f"{name}: missing {path} (expected a .jsonl.gz file of {{'text': ...}} lines)"
            )
        self.name = name
        self.path = path

    def iter_from(self, doc_index: int) -> Iterator[str]:
        with gzip.open(self.path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                # Skipped lines are decompressed but not parsed: cheap for the shipped sizes.
                if i >= doc_index:
                    yield json.loads(line)[TEXT_FIELD]


@dataclass(frozen=True)
class HubSpec:
    path: str
    config_name: str | None
    # None: the dataset has no validation split; hold validation out of "train" by index.
    validation_split: str | None


HUB_DATASETS = {
    "c4": HubSpec("allenai/c4", "en", "validation"),
    "fineweb": HubSpec("HuggingFaceFW/fineweb", "sample-10BT", None),
}


class HubStreamSource(DocumentSource):
    """A Hugging Face dataset read with ``streaming=True``; opened on first iteration so that
    building the source needs no network."""

    resumable = True  # IterableDataset.skip(n) starts at document n without decoding earlier ones

    def __init__(self, name: str, spec: HubSpec, split: Split, path_override: str | None) -> None:
        self.name = name
        self.spec = spec
        self.split = split
        self.path = path_override or spec.path

    def _stream(self, start: int) -> Iterator[str]:
        import datasets

        hub_split = self.spec.validation_split if self.split == "validation" else None
        hub_split = hub_split or "train"  # without a validation split, both splits read "train"
        ds = datasets.load_dataset(self.path, name=self.spec.config_name, split=hub_split, streaming=True)
        for example in ds.skip(start):
            yield example[TEXT_FIELD]

    def iter_from(self, doc_index: int) -> Iterator[str]:
        if self.spec.validation_split is not None:
            yield from self._stream(doc_index)
            return
        start = holdout_start(doc_index, self.split)
        for i, text in enumerate(self._stream(start), start):
            if in_split(i, self.split):
                yield text


def local_data_files(dataset_path: str) -> tuple[str, list[str]]:
    """Resolve a file, folder or glob into (datasets builder name, sorted file list)."""

    def fmt(path: str) -> str | None:
        p = Path(path)
        suffix = Path(p.stem).suffix if p.suffix == ".gz" else p.suffix
        return LOCAL_FORMATS.get(suffix.lower())

    expected = "json, jsonl, parquet or txt files (optionally .gz)"
    if any(c in dataset_path for c in "*?["):
        files = sorted(f for f in glob.glob(dataset_path, recursive=True) if Path(f).is_file())
    elif Path(dataset_path).is_dir():
        files = sorted(str(f) for f in Path(dataset_path).rglob("*") if f.is_file() and fmt(str(f)))
    elif Path(dataset_path).is_file():
        files = [dataset_path]
    else:
        raise FileNotFoundError(
            f"local dataset path {dataset_path} does not exist (expected a file, folder or glob of {expected})"
        )
    formats = {fmt(f) for f in files}
    if not files:
        raise FileNotFoundError(f"local dataset path {dataset_path} matches no {expected}")
    if None in formats or len(formats) > 1:
        raise ValueError(
            f"local dataset path {dataset_path} must hold {expected} of one format, found: {files[:5]}"
        )
    empty = [f for f in files if Path(f).stat().st_size == 0]
    if empty:
        raise ValueError(f"local dataset file {empty[0]} is empty: remove it or point dataset_path elsewhere")
    return formats.pop(), files  # type: ignore[return-value]


def _first_bad_json_line(files: list[str]) -> str | None:
    """`file:line: ...` of the first line of JSON-lines files that does not parse, if any."""
    for file in files:
        opener = gzip.open if file.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except ValueError as e:
                        return f"{file}:{lineno}: not valid JSON ({e}): {line.strip()[:60]!r}"
    return None


class LocalFilesSource(DocumentSource):
    """Local files loaded (non-streaming) with ``datasets``; the hold-out rule splits them."""

    resumable = True  # random access: starting at document n reads nothing before it

    def __init__(self, dataset_path: str, split: Split) -> None:
        import datasets

        builder, files = local_data_files(dataset_path)
        # txt: one document per blank-line-separated paragraph, so that a single large file
        # still yields many documents (per-line documents would be too short to be useful).
        extra: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", **extra)
        except Exception as e:  # datasets wraps any file's parse error in DatasetGenerationError
            where = (_first_bad_json_line(files) if builder == "json" else None) or f"{e.__cause__ or e}"
            raise ValueError(f"local dataset {dataset_path} cannot be read: {where}") from None
        if TEXT_FIELD not in ds.column_names:
            raise ValueError(
                f"local dataset {dataset_path} has no {TEXT_FIELD!r} column; columns: {ds.column_names}"
            )
        self.name = "local"
        self.split = split
        self._texts = ds.select_columns([TEXT_FIELD])
        self._indices = [i for i in range(len(self._texts)) if in_split(i, split)]

    def iter_from(self, doc_index: int) -> Iterator[str]:
        for row in self._texts.select(self._indices[doc_index:]):
            yield row[TEXT_FIELD]


class ChatSource(DocumentSource):
    """A jsonl(.gz) file of chat records (SFT; rendered by chat.py); every 100th line is validation."""

    resumable = True

    def __init__(self, path: str | None, split: Split) -> None:
        if not path or not Path(path).is_file():
            raise FileNotFoundError(
                f"dataset 'chat' needs --training.dataset_path to be a jsonl(.gz) file of chat records, got {path}"
            )
        self.name, self.path, self.split = "chat", Path(path), split

    def iter_from(self, doc_index: int) -> Iterator[dict]:
        opener = gzip.open if self.path.suffix == ".gz" else open
        seen = 0
        with opener(self.path, "rt", encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip() or not in_split(i, self.split):
                    continue
                if seen >= doc_index:
                    yield json.loads(line)
                seen += 1


def _stdlib_docs(dataset_path: str | None, split: Split) -> DocumentSource:
    folder = Path(dataset_path) if dataset_path else STDLIB_DOCS_DIR
    return JsonlGzSource("stdlib_docs", folder / f"{split}.jsonl.gz")


def _local(dataset_path: str | None, split: Split) -> DocumentSource:
    if not dataset_path:
        raise ValueError(
            "dataset 'local' needs dataset_path: a file, folder or glob of json/jsonl/parquet/txt files"
        )
    return LocalFilesSource(dataset_path, split)


def _chat(dataset_path: str | None, split: Split) -> DocumentSource:
    return ChatSource(dataset_path, split)


def _hub(name: str) -> Callable[[str | None, Split], DocumentSource]:
    return lambda dataset_path, split: HubStreamSource(name, HUB_DATASETS[name], split, dataset_path)


DATASETS: dict[str, Callable[[str | None, Split], DocumentSource]] = {
    "stdlib_docs": _stdlib_docs,
    "local": _local,
    "chat": _chat,
    **{name: _hub(name) for name in HUB_DATASETS},
}


def open_documents(dataset: str, dataset_path: str | None, split: Split) -> DocumentSource:
    """The documents of ``split`` of ``dataset``; ``dataset_path`` overrides where they are read."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    factory = DATASETS.get(dataset)
    if factory is None:
        near = difflib.get_close_matches(dataset, DATASETS, n=3, cutoff=0.3)
        hint = f"did you mean {' or '.join(repr(n) for n in near)}? " if near else ""
        raise ValueError(f"unknown dataset {dataset!r}: {hint}valid names: {', '.join(sorted(DATASETS))}")
    return factory(dataset_path, split)
