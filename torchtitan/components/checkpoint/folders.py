"""The on-disk format of a checkpoint folder: naming, completion manifest, validation and retention.

    {root}/step-N.partial   being written (or a save that was interrupted): never loaded, never deleted here
    {root}/step-N           complete: DCP files + `.metadata` + `manifest.json` + `config.toml`
    {root}/step-N.reclaiming  being removed by retention (renamed first, so it can never look complete)
    {root}/export-step-N      model weights only (checkpoint.last_save): for tools, never resumed from
    {root}/versions.json      the version store: live versions (why kept, what each refers to), removals under way
    {root}/leases/            readers' holds on steps (retention leaves a held step alone)
    {root}/latest.json        on an object store: the newest completed step (a hint where a listing lags)

On an object store (`root` an fsspec URL, see tools/storage.py) nothing is renamed: a save writes into
`step-N` directly and the manifest, written last, is what makes it complete; a `step-N` without one is an
unfinished save (skipped with a warning, replaced by a later save of that step), and retention deletes a
manifest first. Listings are hints: the manifest and the files' own sizes decide.

The manifest is written last, once every rank's files are on disk, and lists each file with its size and
(format 2 on) its CRC-32, computed while the file was written (checkpoint_checksums.py); a folder whose files
do not match it (truncated copy, half-deleted folder, lost file, a changed byte) is reported as corrupt. Its
`format_version` says which of these it records: 1 (absent; sizes only), 2 (sizes and checksums). A newer
version than FORMAT_VERSION is refused: its meaning is unknown to this code.
"""

import os
import re
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from torchtitan.tools import storage
from torchtitan.components.checkpoint.checksums import file_checksum
from torchtitan.tools import fault_injection
from torchtitan.tools.logging import logger

STEP_DIR = re.compile(r"^step-(\d+)$")
EXPORT_DIR = re.compile(r"^export-step-(\d+)$")
PARTIAL = ".partial"
RECLAIMING = ".reclaiming"
MANIFEST = "manifest.json"
VERSIONS = "versions.json"  # the version store: live versions, what each refers to, removals in progress
LEASES = "leases"  # readers' holds on steps
CONFIG = "config.toml"
DCP_METADATA = ".metadata"
LATEST = "latest.json"  # {"step": N} of the newest completed save: a hint for a lagging listing
FORMAT_VERSION = 2  # 1: sizes only (no format_version key); 2: + per-file content checksums


def step_folder(root: str, step: int) -> str:
    return storage.join(root, f"step-{step}")


def export_folder(root: str, step: int) -> str:
    return storage.join(root, f"export-step-{step}")


def partial_name(final: str) -> str:
    """Where a save of `final` is written: `final.partial` on a local disk (renamed when complete); the final
    name itself on a store, which has no rename (the manifest, written last, is the completion marker)."""
    return final if storage.is_url(final) else final + PARTIAL


def _steps_named(root: str, pattern: re.Pattern) -> list[int]:
    return sorted(int(m.group(1)) for name in storage.listdir(root) if (m := pattern.match(name)))


def named_steps(root: str) -> list[int]:
    """Steps with a folder named complete (step-N), oldest first; their content is not checked here."""
    return _steps_named(root, STEP_DIR)


def export_steps(root: str) -> list[int]:
    """Steps with a model-only export (export-step-N), oldest first."""
    return _steps_named(root, EXPORT_DIR)


def leftovers(root: str, suffix: str) -> list[str]:
    return [name for name in storage.listdir(root) if name.endswith(suffix)]


def latest_pointer(root: str) -> int | None:
    """The step the newest completed save recorded in LATEST (on a store, where a listing may lag behind the
    writes): a hint to look at, never trusted without that step's manifest."""
    try:
        return int(storage.read_json(storage.join(root, LATEST))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def code_version() -> dict:
    """What wrote a checkpoint: the git commit of the source tree when there is one, and package versions."""
    import torchtitan

    here = os.path.dirname(os.path.abspath(torchtitan.__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"git_commit": commit, "torchtitan": torchtitan.__version__, "torch": torch.__version__}


def write_manifest(folder: str, info: dict, checksums: dict[str, str]) -> None:
    """Records every file of a finished checkpoint with its size and the checksum its writer computed (the
    completion marker). A file no writer hashed (one written by a writer of another kind) is hashed here, by
    reading it, and listed under `checksums_read_back`; the trainer's own saves list none."""
    files = storage.file_sizes(folder)
    # Every file a writer recorded is listed, asked for by name when the listing lacks it (a store's listing
    # may lag behind its writes; a read by name does not).
    files.update({name: storage.size(storage.join(folder, name)) for name in set(checksums) - set(files)})
    files.pop(MANIFEST, None)
    read_back = sorted(set(files) - set(checksums))
    checksums = {**checksums, **{name: file_checksum(storage.join(folder, name)) for name in read_back}}
    manifest = {**info, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **code_version(), "files": files,
                "checksums": {k: checksums[k] for k in sorted(files)}, "format_version": FORMAT_VERSION}
    if read_back:
        manifest["checksums_read_back"] = read_back
    storage.write_json(storage.join(folder, MANIFEST), manifest)  # whole or absent: a rename locally, one PUT on a store


def problem(folder: str, *, require_manifest: bool = True) -> str | None:
    """Why `folder` is not a usable checkpoint, or None when it is.

    Checkpoints from elsewhere (e.g. a converted model) may lack our manifest; then only DCP's own
    `.metadata` is required and file sizes cannot be checked."""
    if not storage.isdir(folder):
        return "no such folder"
    manifest_path = storage.join(folder, MANIFEST)
    try:
        manifest = storage.read_json(manifest_path)  # one GET: an object store's reads are consistent
        files = manifest["files"]
    except FileNotFoundError:
        if require_manifest:
            return f"no {MANIFEST} (the save did not finish)"
        return None if storage.isfile(storage.join(folder, DCP_METADATA)) else "not a DCP checkpoint (no .metadata)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    newer = newer_format(manifest)
    if newer:
        return newer
    listed = storage.file_sizes(folder)  # one listing; a file it lacks (a lagging listing) is asked for directly
    for name, size in sorted(files.items()):
        try:
            actual = listed[name] if name in listed else storage.size(storage.join(folder, name))
        except FileNotFoundError:
            return f"missing file {name}"
        if actual != size:
            return f"file {name} has {actual} bytes, {size} were written (truncated or corrupt)"
    return None


def newer_format(manifest: dict) -> str | None:
    """The line refusing a manifest of a format this code does not know, or None."""
    version = manifest.get("format_version", 1)
    if isinstance(version, int) and version <= FORMAT_VERSION:
        return None
    return (f"checkpoint format {version} was written by a newer torchtitan ({manifest.get('torchtitan', '?')}, "
            f"commit {manifest.get('git_commit') or '?'}); this code reads formats up to {FORMAT_VERSION}: "
            f"upgrade torchtitan to load it")


def read_manifest(folder: str) -> dict:
    return storage.read_json(storage.join(folder, MANIFEST))


@dataclass
class ResumeChoice:
    step: int | None
    skipped: dict[str, str]  # folder name -> problem


def choose_resume_step(root: str, content_problem=None) -> ResumeChoice:
    """The newest usable checkpoint; the newer unusable ones are reported, not touched. `content_problem`
    (folder -> problem or None) judges the content of a folder whose files have the recorded sizes."""
    skipped = {}
    steps = set(named_steps(root))
    pointer = latest_pointer(root)
    if pointer is not None and pointer not in steps:
        # The listing lacks the newest save (a store's listing can lag): its manifest, read directly, decides.
        logger.info(f"{root}: the listing lacks step-{pointer}, which {LATEST} names; judging it by its manifest")
        steps.add(pointer)
    for step in sorted(steps, reverse=True):
        why = problem(step_folder(root, step))
        if why is None and content_problem is not None:
            why = content_problem(step_folder(root, step))
        if why is None:
            return ResumeChoice(step, skipped)
        skipped[f"step-{step}"] = why
    return ResumeChoice(None, skipped)


@dataclass(frozen=True)
class Retention:
    """Which complete checkpoints are kept: the newest `keep_latest` (0: all), every `every`-th step (0: none)
    and the named `steps`, forever."""

    keep_latest: int
    every: int = 0
    steps: frozenset[int] = frozenset()

    def reason(self, step: int, valid: list[int]) -> str | None:
        if self.keep_latest <= 0:
            return "all"
        if step in valid[-self.keep_latest :]:
            return "latest"
        if self.every and step % self.every == 0:
            return "milestone"
        if step in self.steps:
            return "named"
        return None


def read_store(root: str) -> dict:
    """The version store (VERSIONS): {"format": 1, "versions": {name: {"step", "kept_as", "refs"}}, "removing":
    [names]}. `refs` are the paths (relative to root) a version's files live in, today its own folder; a later
    version that shares files (e.g. frozen weights saved once) lists the shared path too, and a path is deleted
    only when no live version refers to it, so sharing needs no new format."""
    try:
        return storage.read_json(storage.join(root, VERSIONS))
    except (OSError, ValueError):
        return {"format": 1, "versions": {}, "removing": []}


def _write_store(root: str, store: dict) -> None:
    storage.write_json(storage.join(root, VERSIONS), store)  # whole or absent: the intent survives a kill


def leases(root: str) -> set[int]:
    """Steps a reader holds (`hold`): never removed while held."""
    folder = storage.join(root, LEASES)
    held = set()
    for name in storage.listdir(folder):
        try:
            held.add(int(storage.read_json(storage.join(folder, name))["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return held


@contextmanager
def hold(root: str, step: int):
    """A reader's lease on `step` (e.g. an evaluation job reading it): retention leaves it alone meanwhile."""
    folder = storage.join(root, LEASES)
    storage.makedirs(folder)
    path = storage.join(folder, f"{os.getpid()}-{threading.get_ident()}-{step}.json")
    storage.write_json(path, {"step": step, "pid": os.getpid()})
    try:
        yield
    finally:
        storage.remove(path)


def _retire(folder: str) -> None:
    """Makes a complete checkpoint incomplete for good, before its files go: locally renamed to `.reclaiming`;
    on a store (no rename) its manifest is deleted first, so a removal cut short leaves a folder that can
    never be taken for a checkpoint."""
    if storage.is_url(folder):
        storage.remove(storage.join(folder, MANIFEST))
    else:
        os.replace(folder, folder + RECLAIMING)


def _retired(root: str, removing: list[str]) -> list[str]:
    """The folders whose removal is under way: `.reclaiming` ones locally; on a store, those the intent names
    that have no manifest (protected ones kept theirs)."""
    if not storage.is_url(root):
        return [storage.join(root, name) for name in leftovers(root, RECLAIMING)]
    folders = [storage.join(root, name) for name in removing]
    return [f for f in folders if not storage.isfile(storage.join(f, MANIFEST))]


class Reclaimer:
    """Garbage-collects the version store in a background thread (rank 0 only).

    A pass lists the complete, valid checkpoints, keeps the ones the Retention keeps plus the newest, the
    `protect`ed ones (the step just saved, the one loaded) and those a reader holds, and removes the rest:
    first the store is rewritten with the live versions and the doomed ones under "removing" (the intent),
    then each doomed folder is retired (renamed to `.reclaiming`, or on a store its manifest deleted: it can
    never look complete again) and deleted, then
    the intent is cleared. `recover` (at the next start) finishes an interrupted removal, or undoes the part of
    it that would touch a step now protected. Corrupt folders are never counted nor removed, and `.partial`
    ones (a save in flight) are not versions at all."""

    def __init__(self, root: str, retention: Retention):
        self.root, self.retention = root, retention
        self._thread: threading.Thread | None = None

    def start(self, protect: set[int]) -> None:
        if self.retention.keep_latest <= 0:
            return
        self.wait()
        self._thread = threading.Thread(target=self._run, args=(set(protect),), name="ckpt-reclaim", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def recover(self, protect: set[int] = frozenset()) -> None:
        """Finishes (or, for a protected step, undoes) a removal a kill interrupted."""
        store = read_store(self.root)
        pending = store.get("removing", [])
        for name in pending:
            folder = storage.join(self.root, name)
            m = STEP_DIR.match(name)
            if storage.isdir(folder) and not (m and int(m.group(1)) in protect):
                _retire(folder)
        for folder in _retired(self.root, pending):
            logger.info(f"Checkpoint retention: finishing the interrupted removal of {storage.basename(folder)}")
            storage.remove_tree(folder)
        if pending:
            store["removing"] = []
            _write_store(self.root, store)

    def _run(self, protect: set[int]) -> None:
        valid = [s for s in named_steps(self.root) if problem(step_folder(self.root, s)) is None]
        keep = {s: self.retention.reason(s, valid) for s in valid}
        for s in protect | leases(self.root) | set(valid[-1:]):
            keep[s] = keep.get(s) or "in use"
        live = {s: why for s, why in keep.items() if why}
        doomed = [s for s in valid if s not in live]
        store = {"format": 1, "removing": [f"step-{s}" for s in doomed],
                 "versions": {f"step-{s}": {"step": s, "kept_as": why, "refs": [f"step-{s}"]} for s, why in
                              sorted(live.items())}}
        referenced = {r for v in store["versions"].values() for r in v["refs"]}
        if not doomed and not storage.isfile(storage.join(self.root, VERSIONS)):
            return  # nothing removed yet: the store is written by the first pass that removes something
        _write_store(self.root, store)
        for step in doomed:
            folder = step_folder(self.root, step)
            if storage.basename(folder) in referenced:
                continue  # a live version still refers to it
            try:
                _retire(folder)
            except OSError as e:
                logger.warning(f"Checkpoint retention: could not remove {folder}: {e}")
                continue
            fault_injection.removal_point(step)
            logger.info(f"Checkpoint retention (keep_latest_k={self.retention.keep_latest}, keep_every_n_steps="
                        f"{self.retention.every}, keep_steps={sorted(self.retention.steps)}): removing {folder}")
        for folder in _retired(self.root, store["removing"]):
            storage.remove_tree(folder)
        store["removing"] = []
        _write_store(self.root, store)
