"""Document sources: shipped corpus, local files with hold-out, hub registry (no network)."""

from __future__ import annotations

import gzip
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from torchtitan.datasets import sources
from torchtitan.datasets.sources import HubStreamSource, holdout_start, in_split, open_documents

N_DOCS = 250  # hold-out every 100th: validation = docs 0, 100, 200
VALIDATION = [0, 100, 200]
TRAIN = [i for i in range(N_DOCS) if i not in VALIDATION]


def doc(i: int) -> str:
    return f"document {i}\nsecond line of {i}"


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep datasets' arrow cache under tmp (apart from test data folders); forbid hub access."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def test_stdlib_docs_splits_are_disjoint_and_non_empty() -> None:
    train = list(open_documents("stdlib_docs", None, "train").iter_from(0))
    validation = list(open_documents("stdlib_docs", None, "validation").iter_from(0))
    assert len(train) > 100 and len(validation) > 5
    assert all(isinstance(t, str) and t for t in train + validation)
    assert not set(train) & set(validation)


def test_stdlib_docs_iter_from_matches_slice() -> None:
    source = open_documents("stdlib_docs", None, "train")
    assert source.name == "stdlib_docs" and source.resumable
    head = list(itertools.islice(source.iter_from(0), 40))
    for n in (0, 1, 17, 39):
        assert list(itertools.islice(source.iter_from(n), 40 - n)) == head[n:]


def test_stdlib_docs_path_override(tmp_path: Path) -> None:
    with gzip.open(tmp_path / "validation.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": doc(i)}) + "\n" for i in range(3))
    assert list(open_documents("stdlib_docs", str(tmp_path), "validation").iter_from(1)) == [doc(1), doc(2)]
    with pytest.raises(FileNotFoundError, match="train.jsonl.gz"):
        open_documents("stdlib_docs", str(tmp_path), "train")


def test_holdout_index_mapping() -> None:
    for split in ("train", "validation"):
        members = [i for i in range(1000) if in_split(i, split)]
        assert [holdout_start(n, split) for n in range(len(members))] == members


def _write_jsonl(path: Path) -> None:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"id": i, "text": doc(i)}) + "\n" for i in range(N_DOCS))


def _write_txt(path: Path) -> None:
    path.write_text("\n\n".join(doc(i) for i in range(N_DOCS)), encoding="utf-8")


def _write_parquet(path: Path) -> None:
    import datasets

    datasets.Dataset.from_dict({"text": [doc(i) for i in range(N_DOCS)]}).to_parquet(str(path))


@pytest.mark.parametrize(
    ("filename", "writer"),
    [
        ("data.jsonl", _write_jsonl),
        ("data.json.gz", _write_jsonl),
        ("data.txt", _write_txt),
        ("data.parquet", _write_parquet),
    ],
)
def test_local_files_hold_out_every_100th(tmp_path: Path, filename: str, writer) -> None:
    writer(tmp_path / filename)
    train = open_documents("local", str(tmp_path / filename), "train")
    validation = open_documents("local", str(tmp_path), "validation")  # folder form
    assert train.resumable and train.name == "local"
    assert list(validation.iter_from(0)) == [doc(i) for i in VALIDATION]
    assert list(train.iter_from(0)) == [doc(i) for i in TRAIN]
    assert list(train.iter_from(150)) == [doc(i) for i in TRAIN[150:]]
    assert list(validation.iter_from(2)) == [doc(200)]


def test_local_glob_keeps_sorted_file_order(tmp_path: Path) -> None:
    for name, first in (("b.jsonl", 1), ("a.jsonl", 0)):
        rows = (json.dumps({"text": f"{name}-{i}"}) + "\n" for i in range(first, 150, 2))
        (tmp_path / name).write_text("".join(rows))
    texts = list(open_documents("local", str(tmp_path / "*.jsonl"), "validation").iter_from(0))
    assert texts == ["a.jsonl-0", "b.jsonl-51"]  # a holds 75 docs, so document 100 is b's 26th


def test_local_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_documents("local", str(tmp_path / "missing.jsonl"), "train")
    with pytest.raises(FileNotFoundError, match="matches no"):
        open_documents("local", str(tmp_path), "train")
    with pytest.raises(ValueError, match="needs dataset_path"):
        open_documents("local", None, "train")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"content": "x", "id": 1}) + "\n")
    with pytest.raises(ValueError, match=r"no 'text' column; columns: \['content', 'id'\]"):
        open_documents("local", str(tmp_path / "rows.jsonl"), "train")


def test_unknown_dataset_names_nearest() -> None:
    with pytest.raises(ValueError, match="did you mean 'fineweb'") as info:
        open_documents("fine_web", None, "train")
    assert "stdlib_docs" in str(info.value)
    with pytest.raises(ValueError, match="split"):
        open_documents("stdlib_docs", None, "test")  # type: ignore[arg-type]


def test_hub_sources_open_without_network() -> None:
    c4 = open_documents("c4", None, "validation")
    fineweb = open_documents("fineweb", "/data/fineweb-copy", "train")
    assert isinstance(c4, HubStreamSource) and c4.path == "allenai/c4" and c4.resumable
    assert isinstance(fineweb, HubStreamSource) and fineweb.path == "/data/fineweb-copy"


def test_hub_hold_out_without_validation_split(monkeypatch: pytest.MonkeyPatch) -> None:
    requested_starts: list[int] = []

    def fake_stream(self: HubStreamSource, start: int) -> Iterator[str]:
        requested_starts.append(start)
        return (doc(i) for i in range(start, N_DOCS))

    monkeypatch.setattr(HubStreamSource, "_stream", fake_stream)
    train = open_documents("fineweb", None, "train")
    validation = open_documents("fineweb", None, "validation")
    assert list(validation.iter_from(1)) == [doc(100), doc(200)]
    assert list(train.iter_from(0)) == [doc(i) for i in TRAIN]
    assert list(train.iter_from(120)) == [doc(i) for i in TRAIN[120:]]
    assert requested_starts == [100, 1, TRAIN[120]]  # skipping happens in the stream, not by reading
    assert sources.HUB_DATASETS["fineweb"].validation_split is None
