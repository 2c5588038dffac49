"""Pre-tokenized shards: the on-disk format written by `python -m torchtitan.datasets.pretokenize`.

A shard folder holds one split of one source:

    <folder>/manifest.json          what the shards are: source, tokenizer (name + sha256), dtype, parts
    <folder>/part-00000.tokens      the tokens of documents [0, N), concatenated (raw little-endian uint16/32)
    <folder>/part-00000.docs        int64 end offset of each document inside the part (the document index)
    <folder>/part-00000.json        written last: marks the part complete (resumable writing); records the
                                    part's counts and the CRC-32 of its two files' bytes

Every document is stored as the training stream packs it: BOS, its tokens, EOS. The concatenation of all
parts in order is the same token stream the raw-text loader builds, so a run reads the same windows from
shards as from raw text; window w is tokens [w*W, (w+1)*W) of it, read through a memory map without
touching any other window.

Opening a shard set checks every part's file sizes against its counts (a part cut short is refused in one line
naming it, before the first step); the first read of a part in a process checks its CRC-32 (a changed byte,
size unchanged), so every part a rank reads is verified once, just before its first window is used. Parts
written before the checksums existed are checked for size only.

The folder may be an object store URL (`s3://bucket/shards/web/train`, tools/storage.py): the sizes come
from one listing, each window is one ranged read of its bytes, and the store's own checksums stand in for the
per-part CRC (see _RemotePart). Upload a folder written by pretokenize as it is (e.g. `aws s3 cp --recursive`).
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from torchtitan.tools import storage
from torchtitan.components.tokenizer.backends import Tokenizer

MANIFEST = "manifest.json"
FORMAT = "torchtitan-shards-v1"


def is_shard_folder(path: str | os.PathLike[str]) -> bool:
    if storage.is_url(os.fspath(path)):
        return storage.isfile(storage.join(os.fspath(path), MANIFEST))
    return (Path(path) / MANIFEST).is_file()


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict:
    """Name and content hash of a tokenizer: two files with one name but different merges differ here."""
    path = Path(getattr(tokenizer, "path"))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"name": path.name, "sha256": digest, "vocab_size": tokenizer.vocab_size}


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def write_part(folder: Path, index: int, docs: list[list[int]], dtype: np.dtype) -> dict:
    """Writes one part atomically enough to resume: data files first, the small json marker last."""
    name = part_name(index)
    tokens = np.fromiter((t for d in docs for t in d), dtype=dtype)
    ends = np.cumsum([len(d) for d in docs], dtype=np.int64)
    crc = {}
    for suffix, array in ((".tokens", tokens), (".docs", ends)):
        tmp = folder / f"{name}{suffix}.tmp"
        array.tofile(tmp)
        crc[suffix[1:]] = zlib.crc32(array.tobytes())  # of the bytes written, never read back
        os.replace(tmp, folder / f"{name}{suffix}")
    meta = {"name": name, "num_docs": len(docs), "num_tokens": int(tokens.size), "crc32": crc}
    tmp = folder / f"{name}.json.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, folder / f"{name}.json")
    return meta


def read_part_meta(folder: Path, index: int) -> dict | None:
    path = folder / f"{part_name(index)}.json"
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class ShardSet:
    """The token stream of a shard folder, memory-mapped; `tokens(start, n)` reads across part borders. On an
    object store (`folder` a URL) a window is one ranged GET of the bytes it needs (nothing else is read)."""

    folder: Path | str
    manifest: dict

    def __post_init__(self) -> None:
        dtype = np.dtype(self.manifest["dtype"])
        self.remote = storage.is_url(str(self.folder))
        listed = storage.file_sizes(str(self.folder)) if self.remote else None  # one listing, not one per part
        for p in self.manifest["parts"]:
            _check_sizes(self.folder, p, dtype, listed)
        self._parts = [
            None if not p["num_tokens"] else _RemotePart(storage.join(str(self.folder), f"{p['name']}.tokens"), dtype)
            if self.remote else np.memmap(self.folder / f"{p['name']}.tokens", dtype=dtype, mode="r")
            for p in self.manifest["parts"]
        ]
        self._starts = np.cumsum([0] + [p["num_tokens"] for p in self.manifest["parts"]])
        self.num_tokens = int(self._starts[-1])

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def tokens(self, start: int, count: int) -> np.ndarray:
        if start < 0 or start + count > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + count}) outside the {self.num_tokens} of {self.folder}")
        out = []
        part = int(np.searchsorted(self._starts, start, side="right")) - 1
        while count > 0:
            if not self.remote:
                _verify_content(self.folder, self.manifest["parts"][part])
            local = start - int(self._starts[part])
            chunk = self._parts[part][local : local + count] if self._parts[part] is not None else []
            out.append(np.asarray(chunk, dtype=np.int64))
            start, count, part = start + len(chunk), count - len(chunk), part + 1
        return np.concatenate(out)


class _RemotePart:
    """A part's token file on an object store, sliced like the memory map: `part[a:b]` is one ranged read.
    The per-part CRC-32 is not checked here (it would make every rank read every part whole); the store's
    own checksums (on upload and on every transfer) guard the bytes instead."""

    def __init__(self, url: str, dtype: np.dtype):
        self.url, self.dtype = url, dtype

    def __getitem__(self, window: slice) -> np.ndarray:
        size = self.dtype.itemsize
        data = storage.read_range(self.url, window.start * size, window.stop * size)
        return np.frombuffer(data, dtype=self.dtype)


def _rewrite_hint(folder: Path | str, name: str) -> str:
    return (f"rewrite it: delete {storage.join(str(folder), name)}.json and rerun the same pretokenize command (it rewrites only the "
            f"parts without their marker)")


def _check_sizes(folder: Path | str, part: dict, dtype: np.dtype, listed: dict[str, int] | None = None) -> None:
    for suffix, size in ((".tokens", part["num_tokens"] * dtype.itemsize), (".docs", part["num_docs"] * 8)):
        if listed is not None:  # on a store: the listing's sizes
            path = storage.join(str(folder), f"{part['name']}{suffix}")
            actual = listed.get(f"{part['name']}{suffix}")
        else:
            path = folder / f"{part['name']}{suffix}"
            actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            found = "is missing" if actual is None else f"has {actual} bytes, {size} were written (cut short?)"
            raise ValueError(f"shard part {path} {found}; {_rewrite_hint(folder, part['name'])}")


_VERIFIED: set[tuple] = set()  # (path, size, mtime) of files this process checked (a validation loader reopens)


def _verify_content(folder: Path, part: dict) -> None:
    if "crc32" not in part:
        return  # written before checksums: sizes only
    for kind, recorded in part["crc32"].items():
        path = folder / f"{part['name']}.{kind}"
        stat = path.stat()
        key = (str(path), stat.st_size, stat.st_mtime_ns)
        if key in _VERIFIED:
            continue
        crc = 0
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                crc = zlib.crc32(chunk, crc)
        if crc != recorded:
            raise ValueError(
                f"shard part {path} does not match its checksum (crc32 {crc:08x} on disk, {recorded:08x} written): "
                f"its content changed after pretokenize; {_rewrite_hint(folder, part['name'])}"
            )
        _VERIFIED.add(key)


def open_shards(folder: str | os.PathLike[str], tokenizer: Tokenizer) -> ShardSet:
    """The shards at `folder`, refused in one line if missing, incomplete or from another tokenizer."""
    folder = os.fspath(folder) if storage.is_url(os.fspath(folder)) else Path(folder)
    if not is_shard_folder(folder):
        raise FileNotFoundError(
            f"{folder} is not a shard folder (no {MANIFEST}); "
            "write one with `python -m torchtitan.datasets.pretokenize`"
        )
    manifest = storage.read_json(storage.join(str(folder), MANIFEST))
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{folder}: unknown shard format {manifest.get('format')!r} (expected {FORMAT})")
    written, ours = manifest["tokenizer"], tokenizer_fingerprint(tokenizer)
    if written["sha256"] != ours["sha256"]:
        raise ValueError(
            f"shards {folder} were written with tokenizer {written['name']} (sha256 {written['sha256'][:12]}), "
            f"but this run uses {ours['name']} (sha256 {ours['sha256'][:12]}): set --model.tokenizer_path to the "
            f"shards' tokenizer or re-run pretokenize with this one"
        )
    return ShardSet(folder, manifest)
