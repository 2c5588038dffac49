"""Tokenizer interface: shipped tiktoken file, SentencePiece and Hugging Face backends, path lookup."""

from __future__ import annotations

import gzip
import itertools
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from torchtitan.components.tokenizer.backends import (
    SHIPPED_TOKENIZER,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TiktokenTokenizer,
    bounded_pieces,
    build_tokenizer,
    llama3_special_tokens,
)
from torchtitan.datasets.sources import STDLIB_DOCS_DIR

SAMPLE = "Return the sum of x and y.\n\n    >>> add(1, 2)\n    3\n\nÜnïcödé — 日本語 🚀\t\r\n"


@pytest.fixture(scope="module")
def shipped() -> TiktokenTokenizer:
    tok = build_tokenizer(None)
    assert isinstance(tok, TiktokenTokenizer)
    return tok


def test_shipped_tokenizer_layout(shipped: TiktokenTokenizer) -> None:
    assert shipped.vocab_size == 2048
    assert shipped.bos_id == 2000 and shipped.eos_id == 2001
    assert shipped.special_tokens["<|start_header_id|>"] == 2006
    assert shipped.special_tokens["<|end_header_id|>"] == 2007
    assert shipped.special_tokens["<|eot_id|>"] == 2009
    assert sorted(shipped.special_tokens.values()) == list(range(2000, 2048))


def test_special_layout_matches_meta_llama3() -> None:
    specials = llama3_special_tokens(128000)
    assert len(specials) == 256 and max(specials.values()) == 128255
    assert specials["<|begin_of_text|>"] == 128000
    assert specials["<|end_of_text|>"] == 128001
    assert specials["<|start_header_id|>"] == 128006
    assert specials["<|eot_id|>"] == 128009
    assert specials["<|reserved_special_token_246|>"] == 128255


def test_shipped_round_trips_validation_documents(shipped: TiktokenTokenizer) -> None:
    with gzip.open(STDLIB_DOCS_DIR / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f]
    for doc in [*docs, SAMPLE, ""]:
        ids = shipped.encode(doc, bos=False, eos=False)
        assert all(0 <= i < 2000 for i in ids)
        assert shipped.decode(ids) == doc
    # The BPE actually compresses: well under one token per character on in-domain text.
    total_ids = sum(len(shipped.encode(d, bos=False, eos=False)) for d in docs)
    assert total_ids < 0.4 * sum(len(d) for d in docs)


def test_bos_eos_placement(shipped: TiktokenTokenizer) -> None:
    plain = shipped.encode(SAMPLE, bos=False, eos=False)
    assert shipped.encode(SAMPLE, bos=True, eos=False) == [shipped.bos_id, *plain]
    assert shipped.encode(SAMPLE, bos=False, eos=True) == [*plain, shipped.eos_id]
    assert shipped.encode(SAMPLE, bos=True, eos=True) == [shipped.bos_id, *plain, shipped.eos_id]


def test_special_token_text_is_plain_text(shipped: TiktokenTokenizer) -> None:
    text = "a <|begin_of_text|> b <|eot_id|><|end_of_text|>"
    ids = shipped.encode(text, bos=False, eos=False)
    assert all(i < 2000 for i in ids)
    assert shipped.decode(ids) == text


def test_bounded_pieces_limits_runs_and_length() -> None:
    text = "ab" + " " * 23 + "x" * 17 + "\n\n" + "y" * 5 + " " * 7
    pieces = list(bounded_pieces(text, max_chars=20, max_run=6))
    assert "".join(pieces) == text
    for piece in pieces:
        assert len(piece) <= 20
        assert not re.search(r"\s{7,}|\S{7,}", piece)
    assert list(bounded_pieces("")) == [""]


def test_long_runs_encode_and_round_trip(shipped: TiktokenTokenizer) -> None:
    for text in (" " * 300_000, "z" * 300_000, "word " * 100_000 + "\n" * 60_000):
        assert shipped.decode(shipped.encode(text, bos=False, eos=False)) == text


def test_tiktoken_format_tokenizer_model_is_sniffed(tmp_path: Path) -> None:
    shutil.copy(SHIPPED_TOKENIZER, tmp_path / "tokenizer.model")
    tok = build_tokenizer(tmp_path / "tokenizer.model")
    assert isinstance(tok, TiktokenTokenizer) and tok.vocab_size == 2048


@pytest.mark.parametrize("layout", ["original/tokenizer.model", "custom.tiktoken"])
def test_folder_search(tmp_path: Path, layout: str) -> None:
    (tmp_path / layout).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(SHIPPED_TOKENIZER, tmp_path / layout)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, TiktokenTokenizer) and tok.path == tmp_path / layout


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        build_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        build_tokenizer(tmp_path)


def test_tiktoken_file_with_gaps_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("YQ== 0\nYg== 2\n")
    with pytest.raises(ValueError, match="ranks"):
        build_tokenizer(bad)


def _training_text(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    with gzip.open(STDLIB_DOCS_DIR / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in itertools.islice(f, 5)]
    lines = [line for d in docs for line in d.splitlines() if line.strip()]
    corpus.write_text("\n".join(lines), encoding="utf-8")
    return corpus


def test_sentencepiece_backend(tmp_path: Path) -> None:
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        input=str(_training_text(tmp_path)),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=500,
        model_type="bpe",
        minloglevel=2,
    )
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.move(tmp_path / "sp.model", folder / "tokenizer.model")
    tok = build_tokenizer(folder)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (500, 1, 2)
    text = "Return the sum of x and y."
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]
    assert tok.decode(ids[1:-1]) == text
    assert tok.bos_id not in tok.encode("<s> x </s>", bos=False, eos=False)


def _hf_tokenizer(tmp_path: Path, specials: list[str]) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(_training_text(tmp_path))], trainer)
    path = tmp_path / "hf" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_huggingface_backend_well_known_tokens(tmp_path: Path) -> None:
    path = _hf_tokenizer(tmp_path, ["<pad>", "<s>", "</s>"])
    tok = build_tokenizer(path.parent)
    assert isinstance(tok, HuggingFaceTokenizer)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    text = "Return the sum of x and y.\n  ok"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids[1:-1]) == text
    assert 1 not in tok.encode("<s> inside </s>", bos=False, eos=False)


def test_huggingface_backend_reads_tokenizer_config(tmp_path: Path) -> None:
    path = _hf_tokenizer(tmp_path, ["<|bos|>", "<|eos|>", "<s>"])
    config = {"bos_token": {"content": "<|bos|>"}, "eos_token": "<|eos|>"}
    (path.parent / "tokenizer_config.json").write_text(json.dumps(config))
    tok = build_tokenizer(path)
    assert (tok.bos_id, tok.eos_id) == (0, 1)


def test_huggingface_without_tokenizers_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ImportError, match="pip install tokenizers"):
        build_tokenizer(path)
