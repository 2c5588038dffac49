"""The on-disk format of a checkpoint folder: naming, completion manifest, validation and retention.

    {root}/step-N.partial   being written (or a save that was interrupted): never loaded, never deleted here
    {root}/step-N           complete: DCP files + `.metadata` + `manifest.json` + `config.toml`
    {root}/step-N.reclaiming  being removed by retention (renamed first, so it can never look complete)
    {root}/export-step-N      model weights only (checkpoint.last_save): for tools, never resumed from
    {root}/versions.json      the version store: live versions (why kept, what each refers to), removals under way
    {root}/leases/            readers' holds on steps (retention leaves a held step alone)

The manifest is written last, once every rank's files are on disk, and lists each file with its size and
(format 2 on) its CRC-32, computed while the file was written (checkpoint_checksums.py); a folder whose files
do not match it (truncated copy, half-deleted folder, lost file, a changed byte) is reported as corrupt. Its
`format_version` says which of these it records: 1 (absent; sizes only), 2 (sizes and checksums). A newer
version than FORMAT_VERSION is refused: its meaning is unknown to this code.
"""

import json
import os
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

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
FORMAT_VERSION = 2  # 1: sizes only (no format_version key); 2: + per-file content checksums


def step_folder(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step}")


def export_folder(root: str, step: int) -> str:
    return os.path.join(root, f"export-step-{step}")


def _steps_named(root: str, pattern: re.Pattern) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for name in os.listdir(root) if (m := pattern.match(name)))


def named_steps(root: str) -> list[int]:
    """Steps with a folder named complete (step-N), oldest first; their content is not checked here."""
    return _steps_named(root, STEP_DIR)


def export_steps(root: str) -> list[int]:
    """Steps with a model-only export (export-step-N), oldest first."""
    return _steps_named(root, EXPORT_DIR)


def leftovers(root: str, suffix: str) -> list[str]:
    if not os.path.isdir(root):
        return []
    return sorted(name for name in os.listdir(root) if name.endswith(suffix))


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
    files = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            files[os.path.relpath(path, folder)] = os.path.getsize(path)
    files.pop(MANIFEST, None)
    read_back = sorted(set(files) - set(checksums))
    checksums = {**checksums, **{name: file_checksum(os.path.join(folder, name)) for name in read_back}}
    manifest = {**info, "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **code_version(), "files": files,
                "checksums": {k: checksums[k] for k in sorted(files)}, "format_version": FORMAT_VERSION}
    if read_back:
        manifest["checksums_read_back"] = read_back
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(folder, MANIFEST))


def problem(folder: str, *, require_manifest: bool = True) -> str | None:
    """Why `folder` is not a usable checkpoint, or None when it is.

    Checkpoints from elsewhere (e.g. a converted model) may lack our manifest; then only DCP's own
    `.metadata` is required and file sizes cannot be checked."""
    if not os.path.isdir(folder):
        return "no such folder"
    manifest_path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(manifest_path):
        if require_manifest:
            return f"no {MANIFEST} (the save did not finish)"
        return None if os.path.isfile(os.path.join(folder, DCP_METADATA)) else "not a DCP checkpoint (no .metadata)"
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable {MANIFEST} ({type(e).__name__})"
    newer = newer_format(manifest)
    if newer:
        return newer
    for name, size in sorted(files.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"missing file {name}"
        actual = os.path.getsize(path)
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
    with open(os.path.join(folder, MANIFEST)) as f:
        return json.load(f)


@dataclass
class ResumeChoice:
    step: int | None
    skipped: dict[str, str]  # folder name -> problem


def choose_resume_step(root: str, content_problem=None) -> ResumeChoice:
    """The newest usable checkpoint; the newer unusable ones are reported, not touched. `content_problem`
    (folder -> problem or None) judges the content of a folder whose files have the recorded sizes."""
    skipped = {}
    for step in reversed(named_steps(root)):
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
        with open(os.path.join(root, VERSIONS)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"format": 1, "versions": {}, "removing": []}


def _write_store(root: str, store: dict) -> None:
    tmp = os.path.join(root, VERSIONS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(store, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(root, VERSIONS))  # whole or absent: the intent survives a kill


def leases(root: str) -> set[int]:
    """Steps a reader holds (`hold`): never removed while held."""
    folder = os.path.join(root, LEASES)
    held = set()
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name)) as f:
                held.add(int(json.load(f)["step"]))
        except (OSError, ValueError, KeyError):
            continue
    return held


@contextmanager
def hold(root: str, step: int):
    """A reader's lease on `step` (e.g. an evaluation job reading it): retention leaves it alone meanwhile."""
    folder = os.path.join(root, LEASES)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{os.getpid()}-{threading.get_ident()}-{step}.json")
    with open(path, "w") as f:
        json.dump({"step": step, "pid": os.getpid()}, f)
    try:
        yield
    finally:
        os.remove(path)


class Reclaimer:
    """Garbage-collects the version store in a background thread (rank 0 only).

    A pass lists the complete, valid checkpoints, keeps the ones the Retention keeps plus the newest, the
    `protect`ed ones (the step just saved, the one loaded) and those a reader holds, and removes the rest:
    first the store is rewritten with the live versions and the doomed ones under "removing" (the intent),
    then each doomed folder is renamed to `.reclaiming` (it can never look complete again) and deleted, then
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
            folder = os.path.join(self.root, name)
            m = STEP_DIR.match(name)
            if os.path.isdir(folder) and not (m and int(m.group(1)) in protect):
                os.replace(folder, folder + RECLAIMING)
        for name in leftovers(self.root, RECLAIMING):
            logger.info(f"Checkpoint retention: finishing the interrupted removal of {name}")
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
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
        if not doomed and not os.path.isfile(os.path.join(self.root, VERSIONS)):
            return  # nothing removed yet: the store is written by the first pass that removes something
        _write_store(self.root, store)
        for step in doomed:
            folder = step_folder(self.root, step)
            if os.path.basename(folder) in referenced:
                continue  # a live version still refers to it
            try:
                os.replace(folder, folder + RECLAIMING)
            except OSError as e:
                logger.warning(f"Checkpoint retention: could not remove {folder}: {e}")
                continue
            fault_injection.removal_point(step)
            logger.info(f"Checkpoint retention (keep_latest_k={self.retention.keep_latest}, keep_every_n_steps="
                        f"{self.retention.every}, keep_steps={sorted(self.retention.steps)}): removing {folder}")
        for name in leftovers(self.root, RECLAIMING):
            shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        store["removing"] = []
        _write_store(self.root, store)
