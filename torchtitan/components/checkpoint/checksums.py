"""Content checksums of checkpoint files, computed while DCP writes them and verified when a checkpoint loads.

The manifest's sizes catch a truncated or lost file; a byte flipped on disk keeps the size and loads as wrong
weights. Each file's CRC-32 (zlib.crc32: the fastest of the hashes Python ships here, see
scripts/benchmarks/bench_checkpoint_checksums.py; it detects every burst error up to 32 bits and any other change with
probability 1 - 2^-32, which is what bit rot and torn copies need; it is no defence against tampering) is
computed from the bytes as they go to the stream, so the file is never read back at save time:

    ChecksummingWriter   a FileSystemWriter whose streams hash what is written; after its data, each rank
                         writes its files' checksums to a sidecar `checksums-rank-R.json`, which rank 0 folds
                         into the manifest (no collective), and the coordinator keeps `.metadata`'s in memory
    verify_share         at load, this rank's share of the files (every world_size-th) is read and checked,
                         so a checkpoint is read once in all, spread over the ranks
"""

import io
import json
import os
import threading
import zlib
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemBase, FileSystemWriter

from torchtitan.tools import storage

SIDECAR_PREFIX = "checksums-rank-"
ALGORITHM = "crc32"
_READ_CHUNK = 16 << 20


def format_checksum(crc: int) -> str:
    return f"{ALGORITHM}:{crc & 0xFFFFFFFF:08x}"


class _HashingStream(io.RawIOBase):
    """A write stream that updates a CRC-32 with every byte written. DCP writes each file front to back
    (tell() for offsets, never a seek), so the running CRC is the file's."""

    def __init__(self, raw):
        self.raw, self.crc = raw, 0

    def write(self, b) -> int:
        self.crc = zlib.crc32(b, self.crc)
        return self.raw.write(b)

    def seek(self, *args):  # a seek would make the running CRC another file's: refuse rather than lie
        raise io.UnsupportedOperation("checksummed checkpoint streams are written front to back")

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        super().close()  # flushes first
        self.raw.close()


class _ChecksummingFileSystem(FileSystemBase):
    """DCP's file system (the local one, or storage.StoreFileSystem for a URL) with every written stream
    hashed on its way out."""

    def __init__(self, inner: FileSystemBase):
        self.inner = inner
        self.written: dict[str, str] = {}  # file name -> checksum, for the files this process wrote
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self.inner.create_stream(path, mode) as raw:
            stream = _HashingStream(raw)
            yield stream
            with self._lock:
                self.written[_name(path)] = format_checksum(stream.crc)

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)  # `.metadata` is written as `.metadata.tmp`, then renamed
        with self._lock:
            if _name(path) in self.written:
                self.written[_name(new_path)] = self.written.pop(_name(path))

    def concat_path(self, path, suffix):
        return self.inner.concat_path(path, suffix)

    def init_path(self, path, **kwargs):
        return self.inner.init_path(path, **kwargs)

    def mkdir(self, path) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def exists(self, path) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path) -> None:
        self.inner.rm_file(path)

    def ls(self, path):
        return self.inner.ls(path)


def _name(path) -> str:
    return storage.basename(os.fspath(path))


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, on a local folder or a store URL, that records a CRC-32 of every file it writes (see
    the module docstring)."""

    def __init__(self, path: str, rank: int):
        remote = storage.is_url(path)
        # On a store the upload is the durability point (fsync of the local spool would buy nothing).
        super().__init__("/" if remote else path, sync_files=not remote)
        self.fs = _ChecksummingFileSystem(storage.StoreFileSystem(path) if remote else FileSystem())
        self.path = self.fs.init_path(path)
        self.rank_for_sidecar = rank

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)  # FileSystemWriter writes synchronously: its files are done
        data = {name: c for name, c in self.fs.written.items() if not name.startswith(".metadata")}
        sidecar = storage.join(str(self.path), f"{SIDECAR_PREFIX}{self.rank_for_sidecar}.json")
        storage.write_bytes(sidecar, json.dumps(data).encode("utf-8"))
        return future

    def metadata_checksums(self) -> dict[str, str]:
        """The coordinator's `.metadata` checksum (empty on the other ranks)."""
        return {name: c for name, c in self.fs.written.items() if name.startswith(".metadata")}


def collect_sidecars(folder: str) -> dict[str, str]:
    """Every rank's recorded checksums (rank 0, when the manifest is written); the sidecars are removed, the
    manifest holds them from then on."""
    out: dict[str, str] = {}
    for name in storage.listdir(folder):
        if name.startswith(SIDECAR_PREFIX) and name.endswith(".json"):
            path = storage.join(folder, name)
            out.update(storage.read_json(path))
            storage.remove(path)
    return out


def file_checksum(path: str) -> str:
    crc = 0
    with storage.open_read(path) as f:
        while chunk := f.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return format_checksum(crc)


def first_mismatch(folder: str, checksums: dict[str, str], rank: int = 0, world_size: int = 1) -> str | None:
    """The first of this rank's share of `checksums` (sorted names, every world_size-th from `rank`) whose
    content differs on disk: its problem line, or None."""
    for name in sorted(checksums)[rank::world_size]:
        actual = file_checksum(storage.join(folder, name))
        if actual != checksums[name]:
            return f"file {name} does not match its checksum ({actual} on disk, {checksums[name]} written): " \
                   f"its content changed after the save (bit rot, a bad copy)"
    return None


def verify_share(folder: str, checksums: dict[str, str]) -> str | None:
    """The checksum problem of `folder`, judged by all ranks together (each reads its share) so that every
    rank returns the same answer; None when every file matches."""
    if not dist.is_initialized():
        return first_mismatch(folder, checksums)
    mine = first_mismatch(folder, checksums, dist.get_rank(), dist.get_world_size())
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return next((p for p in found if p is not None), None)
