"""Tokenizers: one interface over tiktoken (Llama 3 format), SentencePiece and Hugging Face files.

``build_tokenizer(None)`` returns the byte-level BPE tokenizer shipped with torchtitan (trained
by ``scripts/data/train_tokenizer.py`` on the shipped corpus); a path picks the backend from the
file name or content.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torchtitan.tools import storage

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "assets" / "tokenizer" / "stdlib_bpe.tiktoken"

# Meta's Llama 3 pre-tokenisation pattern (tiktoken compiles it in Rust, so \p{..} is fine).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Named specials in Llama 3's order, so their ids match Meta's (begin_of_text = n_regular, ...).
LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
# Total vocab is padded with reserved specials to a multiple of this: 128000 regular tokens
# give Meta's 128256, our 2000 give 2048 (also a friendly size for the embedding matmul).
SPECIALS_PAD_MULTIPLE = 256

# tiktoken's encoder slows down badly (and can recurse deeply) on very long inputs or runs
# of one character class, so text is fed to it in bounded pieces.
MAX_ENCODE_CHARS = 400_000
MAX_RUN_CHARS = 25_000

# Well-known spellings, tried in order when tokenizer_config.json does not name the token.
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[CLS]", "<|endoftext|>")
EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[SEP]")


class Tokenizer(ABC):
    """Text <-> token ids. ``encode`` never interprets special-token text inside documents."""

    vocab_size: int
    bos_id: int
    eos_id: int

    @abstractmethod
    def _encode_text(self, text: str) -> list[int]:
        """Encode plain text, without BOS/EOS."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str: ...

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self._encode_text(text)
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids


def llama3_special_tokens(num_regular: int) -> dict[str, int]:
    """Special tokens appended after ``num_regular`` ranks, laid out like Llama 3."""
    named = list(LLAMA3_NAMED_SPECIALS)
    total = -(-(num_regular + len(named)) // SPECIALS_PAD_MULTIPLE) * SPECIALS_PAD_MULTIPLE
    reserved = [f"<|reserved_special_token_{2 + i}|>" for i in range(total - num_regular - len(named))]
    return {name: num_regular + i for i, name in enumerate(named + reserved)}


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``base64(bytes) rank`` file. Read directly rather than through
    ``tiktoken.load``, whose cache is keyed by path and would serve a stale file."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a tiktoken BPE line: {line[:80]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be unique and run from 0 to {len(ranks) - 1}")
    return ranks


# Runs longer than the limit, matched only where a run starts so the scan stays linear.
_LONG_RUN = re.compile(rf"(?<!\s)\s{{{MAX_RUN_CHARS + 1},}}|(?<!\S)\S{{{MAX_RUN_CHARS + 1},}}")


def bounded_pieces(
    text: str, max_chars: int = MAX_ENCODE_CHARS, max_run: int = MAX_RUN_CHARS
) -> Iterator[str]:
    """Split text into consecutive pieces of at most ``max_chars`` characters, none holding a
    run of more than ``max_run`` whitespace or non-whitespace characters. Joining the pieces
    gives back ``text``."""
    long_run = _LONG_RUN if max_run == MAX_RUN_CHARS else re.compile(
        rf"(?<!\s)\s{{{max_run + 1},}}|(?<!\S)\S{{{max_run + 1},}}"
    )
    for start in range(0, max(len(text), 1), max_chars):
        chunk = text[start : start + max_chars]
        if len(chunk) <= max_run:
            yield chunk
            continue
        cut = 0
        for m in long_run.finditer(chunk):
            for pos in range(m.start() + max_run, m.end(), max_run):
                yield chunk[cut:pos]
                cut = pos
        yield chunk[cut:]


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file in Llama 3 format, with Llama 3 specials appended after the ranks."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import tiktoken

        self.path = Path(path)
        ranks = load_tiktoken_ranks(self.path)
        self.special_tokens = llama3_special_tokens(len(ranks))
        self._encoding = tiktoken.Encoding(
            self.path.stem,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = len(ranks) + len(self.special_tokens)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]

    def _encode_text(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in bounded_pieces(text):
            # Special-token spellings in a document are ordinary text, never control ids.
            ids.extend(self._encoding.encode(piece, allowed_special=set(), disallowed_special=()))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._encoding.decode(list(ids))


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece ``.model`` file; BOS/EOS are the model's own control pieces."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        import sentencepiece

        self.path = Path(path)
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(self.path))
        except RuntimeError as e:  # sentencepiece reports an unreadable model as RuntimeError("INTERNAL: ...")
            raise ValueError(f"{self.path} is not a SentencePiece tokenizer model ({e})") from None
        self.vocab_size = self._sp.vocab_size()
        self.bos_id = self._sp.bos_id()
        self.eos_id = self._sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"{self.path}: SentencePiece model defines no BOS or EOS piece")

    def _encode_text(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``; BOS/EOS from a sibling ``tokenizer_config.json``
    when it names them, else from well-known token spellings."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError as e:
            raise ImportError(
                f"{self.path} is a Hugging Face tokenizer.json, which needs the `tokenizers` "
                "package: pip install tokenizers (or pip install torchtitan[hf])"
            ) from e
        try:
            self._tok = HfTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
            raise ValueError(f"{self.path} is not a Hugging Face tokenizer.json ({e})") from None
        # Special-token spellings in a document are ordinary text, never control ids.
        self._tok.encode_special_tokens = True
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        config = self._read_config(self.path.parent / "tokenizer_config.json")
        self.bos_id = self._token_id(config.get("bos_token"), BOS_CANDIDATES, "BOS")
        self.eos_id = self._token_id(config.get("eos_token"), EOS_CANDIDATES, "EOS")

    @staticmethod
    def _read_config(path: Path) -> dict[str, Any]:
        if not path.is_file():
            return {}
        with open(path, encoding="utf-8") as f:
            return json.load(f)

    def _token_id(self, configured: str | dict[str, Any] | None, candidates: Sequence[str], role: str) -> int:
        if isinstance(configured, dict):  # older configs wrap it as an AddedToken dict
            configured = configured.get("content")
        if configured:
            token_id = self._tok.token_to_id(configured)
            if token_id is None:
                raise ValueError(
                    f"{self.path}: tokenizer_config.json names {role} {configured!r}, not in the vocab"
                )
            return token_id
        for token in candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        raise ValueError(
            f"{self.path}: cannot find a {role} token; add tokenizer_config.json naming it "
            f"or use a vocab with one of {', '.join(candidates)}"
        )

    def _encode_text(self, text: str) -> list[int]:
        # add_special_tokens=False: BOS/EOS are placed by ``encode``, not the post-processor.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+={0,2} \d+\r?\n?$")
# Searched in this order inside a folder; the first hit wins.
FOLDER_CANDIDATES = ("tokenizer.json", "tokenizer.model", "original/tokenizer.model")


def _is_tiktoken_file(path: Path) -> bool:
    with open(path, "rb") as f:
        first = f.readline(4096)
    return bool(_TIKTOKEN_LINE.match(first))


def _find_in_folder(folder: Path) -> Path:
    for name in FOLDER_CANDIDATES:
        if (folder / name).is_file():
            return folder / name
    tiktoken_files = sorted(folder.glob("*.tiktoken"))
    if tiktoken_files:
        return tiktoken_files[0]
    raise FileNotFoundError(
        f"no tokenizer in folder {folder}: expected one of {', '.join(FOLDER_CANDIDATES)} or *.tiktoken"
    )


# Beside a tokenizer file, what its loaders read too (a Hugging Face tokenizer.json's special tokens).
_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def _download(url: str) -> Path:
    """A tokenizer file or folder on an object store, copied to a local folder (the tokenizer libraries read
    local files): the file itself (or, for a folder, the candidates it holds) and its companions. A few MB,
    fetched again at each start; each file written whole under its name (storage.write_bytes)."""
    url = url.rstrip("/")
    local = Path(tempfile.gettempdir()) / f"torchtitan-tokenizer-{hashlib.sha256(url.encode()).hexdigest()[:16]}"
    if storage.isfile(url):
        folder, names = url.rsplit("/", 1)
        names = [names]
        result = local / names[0]
    else:
        folder = url
        listed = storage.listdir(url)
        if not listed:
            raise FileNotFoundError(f"tokenizer path {url} does not exist: expected a tokenizer.json, a *.tiktoken "
                                    f"or tokenizer.model file, or a folder holding one")
        names = [n for n in FOLDER_CANDIDATES if n in listed or (
            "/" in n and storage.isfile(storage.join(url, n)))] + sorted(n for n in listed if n.endswith(".tiktoken"))
        result = local
    for name in [*names, *_COMPANIONS]:
        source = storage.join(folder, name)
        if name in _COMPANIONS and not storage.isfile(source):
            continue
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        storage.write_bytes(str(local / name), storage.read_bytes(source))
    return result


def build_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """The shipped tokenizer for ``None``; otherwise the tokenizer file at ``path`` or found
    inside the folder ``path`` (see ``FOLDER_CANDIDATES``); ``path`` may be an object store URL (the files are
    copied to a local folder first)."""
    if path is None:
        return TiktokenTokenizer(SHIPPED_TOKENIZER)
    if storage.is_url(os.fspath(path)):
        path = _download(os.fspath(path))
    file = Path(path).expanduser()
    if not file.exists():
        raise FileNotFoundError(
            f"tokenizer path {file} does not exist: expected a tokenizer.json, a *.tiktoken or "
            "tokenizer.model file, or a folder holding one"
        )
    if file.is_dir():
        file = _find_in_folder(file)
    if file.suffix == ".json":
        return HuggingFaceTokenizer(file)
    if file.suffix == ".tiktoken" or _is_tiktoken_file(file):
        return TiktokenTokenizer(file)
    if file.suffix == ".model":
        return SentencePieceTokenizer(file)
    raise ValueError(
        f"cannot tell the tokenizer format of {file}: expected tokenizer.json, *.tiktoken, "
        "or a tiktoken / SentencePiece tokenizer.model"
    )
