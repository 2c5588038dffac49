"""Where a run's state lives: a local folder or an object store (`s3://`, `gs://`, `az://`, any fsspec URL).

Every path the checkpoint code reads or writes goes through this module. A plain path (or `file://`) keeps the
local file system's semantics, os calls and atomic renames included; a URL goes through fsspec (s3fs, gcsfs,
adlfs; credentials come only from the environment and those libraries' own config chains, e.g.
AWS_ACCESS_KEY_ID / AWS_PROFILE / an instance role, AWS_ENDPOINT_URL for an S3-compatible server, never from
the job's config). Object stores are not file systems, so on a URL:

- there is no rename: an object is written whole (a PUT, or a multipart upload completed at the end), and a
  checkpoint counts once its manifest object exists, which is written last (folders.py);
- every request is retried with exponential backoff (0.5 s doubling to 8 s) on transient errors (connection
  refused or reset, timeouts, 5xx, throttling) for up to `retry_seconds` (--job.storage_retry_seconds), then
  fails with one line naming the URL and the cause; missing objects and denied access are not retried;
- DCP's files are written by `StoreFileSystem`: DCP writes a file into a local spool (TMPDIR), which is then
  uploaded in PART_BYTES parts, several at once; a fault retries the upload from the spool, never DCP's write;
- listings are never cached (use_listings_cache=False): a listing is only a hint, the manifest decides.
"""

import io
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from torch.distributed.checkpoint.filesystem import FileSystemBase

from torchtitan.tools.logging import logger

T = TypeVar("T")

# Multipart part size: S3 allows at most 10,000 parts and needs >= 5 MiB for all but the last; 64 MiB keeps a
# 640 GB file within the part limit, is large enough that per-request latency (~10-50 ms) costs under 5% at
# ~1 GB/s per stream, and small enough that a retried part resends little. GCS and Azure accept it too.
PART_BYTES = 64 << 20
UPLOAD_CONCURRENCY = 8  # parts of one file in flight at once (s3fs's put_file)

_retry_seconds = 120.0
_fs_cache: dict[str, Any] = {}
_fs_lock = threading.Lock()
os.register_at_fork(after_in_child=_fs_cache.clear)  # a client's connections and event loop stay with its process


def reset_clients() -> None:
    """Forgets the store clients, so the next request reads the environment (endpoint, credentials) again."""
    with _fs_lock:
        _fs_cache.clear()


def set_retry_seconds(seconds: float) -> None:
    """How long a request to the store is retried on transient errors before it fails (the job's setting)."""
    global _retry_seconds
    _retry_seconds = float(seconds)


def is_url(path: str | os.PathLike) -> bool:
    """A path on an object store (any fsspec protocol but the local file system)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def _local(path: str | os.PathLike) -> str:
    text = os.fspath(path)
    return text[len("file://") :] if text.startswith("file://") else text


def join(root: str, *names: str) -> str:
    if is_url(root):
        return "/".join([root.rstrip("/"), *(n.strip("/") for n in names)])
    return os.path.join(_local(root), *names)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def filesystem(url: str):
    """The fsspec file system of a URL's protocol (one per protocol, listings never cached) and the URL's path
    in it."""
    from fsspec.core import split_protocol, url_to_fs

    protocol, _ = split_protocol(url)
    with _fs_lock:
        if protocol not in _fs_cache:
            # One retry policy (`retry` below, one budget, one line at the end) instead of three stacked ones:
            # s3fs's and botocore's own retries are turned off.
            extra = {"config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"}}} \
                if protocol in ("s3", "s3a") else {}
            try:
                fs = url_to_fs(url, use_listings_cache=False, skip_instance_cache=True, **extra)[0]
                if protocol in ("s3", "s3a"):
                    fs.retries = 1
                _fs_cache[protocol] = fs
            except ImportError as e:
                raise StorageError(
                    f"{url}: the {protocol}:// file system needs a package that is not installed ({e}); "
                    f"install it, e.g. pip install 'torchtitan[s3]' for s3://"
                ) from e
        fs = _fs_cache[protocol]
    return fs, fs._strip_protocol(url)


class StorageError(OSError):
    """A request to the store that failed for good; the message names the URL and the cause."""


# ---- transient errors and retries ---------------------------------------------------------------------------
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
              StorageError)
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}


def is_transient(e: BaseException) -> bool:
    """Whether a failed request may succeed when sent again (a network fault or an overloaded store)."""
    if isinstance(e, _PERMANENT):
        return False
    response = getattr(e, "response", None)
    if isinstance(response, dict):  # botocore's ClientError: the store answered; only some answers pass
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return code in _TRANSIENT_CODES or (isinstance(status, int) and status >= 500)
    if isinstance(e, (ConnectionError, TimeoutError, OSError)):
        return True
    module = type(e).__module__ or ""
    return module.startswith(("botocore", "aiobotocore", "aiohttp", "urllib3", "google", "azure", "fsspec"))


def retry(what: str, fn: Callable[[], T], *, seconds: float | None = None) -> T:
    """`fn()`, sent again with exponential backoff on transient errors for up to `seconds`; then StorageError
    with one line: what was asked, how long it was tried, the last cause."""
    budget = _retry_seconds if seconds is None else seconds
    start, delay, attempt = time.monotonic(), 0.5, 0
    while True:
        attempt += 1
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise
            waited = time.monotonic() - start
            if waited + delay > budget:
                first = str(e).strip().splitlines()[0] if str(e).strip() else ""
                raise StorageError(
                    f"{what}: the store did not answer after {attempt} attempts over {waited:.0f}s "
                    f"({type(e).__name__}: {first}); check that it is reachable, or raise --job.storage_retry_seconds"
                ) from e
            if attempt == 1:
                logger.warning(f"{what}: {type(e).__name__}; retrying for up to {budget:.0f}s")
            time.sleep(delay * (0.75 + 0.5 * random.random()))  # jitter: ranks do not retry in lockstep
            delay = min(delay * 2, 8.0)


# ---- file operations (local path or URL) --------------------------------------------------------------------
def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(_local(path))
    fs, p = filesystem(path)
    return retry(f"checking {path}", lambda: fs.exists(p))


def isfile(path: str) -> bool:
    if not is_url(path):
        return os.path.isfile(_local(path))
    fs, p = filesystem(path)
    return retry(f"checking {path}", lambda: fs.isfile(p))


def isdir(path: str) -> bool:
    """A folder; on a store, a prefix holding at least one object."""
    if not is_url(path):
        return os.path.isdir(_local(path))
    fs, p = filesystem(path)
    return retry(f"checking {path}", lambda: fs.isdir(p))


def listdir(path: str) -> list[str]:
    """The names directly under a folder (one listing request on a store, not recursive); [] when absent."""
    if not is_url(path):
        local = _local(path)
        return sorted(os.listdir(local)) if os.path.isdir(local) else []
    fs, p = filesystem(path)

    def ls():
        try:
            return fs.ls(p, detail=False)
        except FileNotFoundError:
            return []

    return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in retry(f"listing {path}", ls)} - {""})


def file_sizes(folder: str) -> dict[str, int]:
    """Every file under `folder` (relative names, '/'-separated) with its size: one recursive listing."""
    if not is_url(folder):
        local, out = _local(folder), {}
        for dirpath, _, names in os.walk(local):
            for name in names:
                full = os.path.join(dirpath, name)
                out[os.path.relpath(full, local)] = os.path.getsize(full)
        return out
    fs, p = filesystem(folder)
    found = retry(f"listing {folder}", lambda: fs.find(p, detail=True))
    prefix = p.rstrip("/") + "/"
    return {k[len(prefix):]: int(v["size"]) for k, v in found.items() if k.startswith(prefix)}


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(_local(path))
    fs, p = filesystem(path)
    return int(retry(f"reading the size of {path}", lambda: fs.info(p))["size"])


def read_bytes(path: str) -> bytes:
    if not is_url(path):
        with open(_local(path), "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return retry(f"reading {path}", lambda: fs.cat_file(p))


def read_range(path: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file: one ranged GET on a store."""
    if not is_url(path):
        with open(_local(path), "rb") as f:
            f.seek(start)
            return f.read(end - start)
    fs, p = filesystem(path)
    return retry(f"reading {path}", lambda: fs.cat_file(p, start=start, end=end))


def read_ranges(path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """Bytes [start, end) of a file for each range; on a store one ranged GET each, sent concurrently (the
    whole set retried on a transient error)."""
    if not ranges:
        return []
    if not is_url(path):
        with open(_local(path), "rb") as f:
            out = []
            for start, end in ranges:
                f.seek(start)
                out.append(f.read(end - start))
            return out
    fs, p = filesystem(path)
    starts, ends = [a for a, _ in ranges], [b for _, b in ranges]
    return retry(f"reading {path}",
                 lambda: fs.cat_ranges([p] * len(ranges), starts, ends, on_error="raise"))


def read_json(path: str) -> Any:
    return json.loads(read_bytes(path))


@contextmanager
def open_read(path: str) -> Iterator[io.IOBase]:
    """A seekable binary read stream; on a store, ranged reads retried on transient errors."""
    if not is_url(path):
        with open(_local(path), "rb") as f:
            yield f
        return
    fs, p = filesystem(path)
    raw = _RetryingReader(fs, p, path)
    try:
        yield io.BufferedReader(raw, buffer_size=1 << 20)
    finally:
        raw.close()


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file: on a local disk through a temporary name and a rename (whole or absent after a
    kill); on a store as one PUT, which is atomic by itself."""
    if not is_url(path):
        local = _local(path)
        tmp = f"{local}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, local)
        return
    fs, p = filesystem(path)
    retry(f"writing {path}", lambda: fs.pipe_file(p, data))


def write_json(path: str, obj: Any) -> None:
    write_bytes(path, json.dumps(obj, indent=1, sort_keys=True).encode("utf-8"))


def remove(path: str) -> None:
    """Removes a file; absent is fine."""
    if not is_url(path):
        try:
            os.remove(_local(path))
        except FileNotFoundError:
            pass
        return
    _remove_on_store(path, recursive=False)


def remove_tree(path: str) -> None:
    """Removes a folder and everything under it; absent is fine."""
    if not is_url(path):
        shutil.rmtree(_local(path), ignore_errors=True)
        return
    _remove_on_store(path, recursive=True)


def _remove_on_store(path: str, recursive: bool) -> None:
    fs, p = filesystem(path)

    def rm():
        try:
            fs.rm(p, recursive=True) if recursive else fs.rm_file(p)
        except FileNotFoundError:
            pass

    retry(f"removing {path}", rm)


def makedirs(path: str) -> None:
    """Creates a local folder; on a store there are no folders (a prefix exists once an object is under it)."""
    if not is_url(path):
        os.makedirs(_local(path), exist_ok=True)


def copy_tree(src: str, dst: str) -> None:
    """Copies a folder within one store (server-side copies: no data passes through this process)."""
    fs, sp = filesystem(src)
    _, dp = filesystem(dst)
    retry(f"copying {src} to {dst}", lambda: fs.copy(sp.rstrip("/") + "/", dp.rstrip("/") + "/", recursive=True))


def copy_out(url: str, local: str) -> None:
    """Downloads a folder (or file) from the store to a local path, e.g. an HF export for transformers."""
    if not is_url(url):
        shutil.copytree(_local(url), local, dirs_exist_ok=True)
        return
    fs, p = filesystem(url)
    retry(f"downloading {url}", lambda: fs.get(p.rstrip("/") + "/", local.rstrip("/") + "/", recursive=True))


def upload_file(local: str, url: str) -> None:
    """Uploads a local file to a store path in PART_BYTES parts (UPLOAD_CONCURRENCY at once), retried whole."""
    fs, p = filesystem(url)
    kwargs = {"chunksize": PART_BYTES, "max_concurrency": UPLOAD_CONCURRENCY} if fs.protocol[0] in ("s3", "s3a") \
        else {}
    retry(f"writing {url}", lambda: fs.put_file(local, p, **kwargs))


def probe(folder: str) -> str | None:
    """Pre-flight: writes, reads back and removes a small object under `folder`. None when the store works,
    else one line naming the URL, the cause and the fix. Sends each request once (no retries): a store that
    does not answer now is reported before any rank starts."""
    target = join(folder, f".torchtitan-probe-{os.getpid()}")
    try:
        fs, p = filesystem(target)
        fs.pipe_file(p, b"probe")
        if fs.cat_file(p) != b"probe":
            return f"{folder}: a test object written there read back different"
        fs.rm_file(p)
    except StorageError as e:
        return str(e)
    except PermissionError as e:
        return f"{folder}: access denied writing a test object ({e}); check the credentials in the environment " \
               f"(AWS_ACCESS_KEY_ID/AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*) and the bucket policy"
    except FileNotFoundError as e:
        return f"{folder}: the bucket does not exist ({e}); create it or fix the URL"
    except Exception as e:  # connection refused, unknown host, timeouts: many types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{folder}: the store cannot be reached ({type(e).__name__}: {first}); check the endpoint " \
               f"(AWS_ENDPOINT_URL for an S3-compatible server) and the network"
    return None


# ---- DCP on a store ---------------------------------------------------------------------------------------
class _RetryingReader(io.RawIOBase):
    """A seekable read stream of one object that reopens at its position and reads again on transient errors."""

    def __init__(self, fs, path: str, url: str):
        self.fs, self.path, self.url, self.pos, self.f = fs, path, url, 0, None
        self.length = retry(f"reading {url}", lambda: int(fs.info(path)["size"]))

    def _open(self):
        if self.f is None:
            self.f = self.fs.open(self.path, "rb", block_size=PART_BYTES)
        return self.f

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def readinto(self, b) -> int:
        def once():
            try:
                f = self._open()
                f.seek(self.pos)
                return f.readinto(b)
            except Exception:
                self._drop()
                raise

        n = retry(f"reading {self.url}", once)
        self.pos += n
        return n

    def _drop(self) -> None:
        f, self.f = self.f, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass

    def close(self) -> None:
        self._drop()
        super().close()


class StoreFileSystem(FileSystemBase):
    """DCP's file system interface on an object store: writes are spooled locally then uploaded whole (so a
    fault retries the upload, not DCP's write, and nothing partial ever has the final name), reads are ranged
    and retried. `rename` (DCP's `.metadata.tmp` -> `.metadata`) is a server-side copy and a delete: the
    checkpoint's completion is its manifest, not this name."""

    def __init__(self, url: str):
        self.fs, _ = filesystem(url)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        url = os.fspath(path)
        if "r" in mode:
            with open_read(url) as stream:
                yield stream
            return
        fd, spool = tempfile.mkstemp(prefix="torchtitan-upload-", suffix=".spool")
        try:
            with open(fd, "wb") as f:
                yield f  # DCP may close it itself
            upload_file(spool, url)
        finally:
            os.remove(spool)

    def concat_path(self, path, suffix: str) -> str:
        return join(os.fspath(path), suffix)

    def init_path(self, path, **kwargs) -> str:
        return os.fspath(path)

    def rename(self, path, new_path) -> None:
        src, dst = os.fspath(path), os.fspath(new_path)
        _, sp = filesystem(src)
        _, dp = filesystem(dst)
        retry(f"copying {src} to {dst}", lambda: self.fs.copy(sp, dp))
        remove(src)

    def mkdir(self, path) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return is_url(os.fspath(checkpoint_id))

    def exists(self, path) -> bool:
        return exists(os.fspath(path))

    def rm_file(self, path) -> None:
        remove(os.fspath(path))

    def ls(self, path) -> list[str]:
        return [join(os.fspath(path), n) for n in listdir(os.fspath(path))]


def dcp_reader(path: str):
    """DCP's reader of a checkpoint folder, local or on a store."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(_local(path) if not is_url(path) else "/")
    if is_url(path):
        reader.fs = StoreFileSystem(path)
        reader.path = path
    return reader
