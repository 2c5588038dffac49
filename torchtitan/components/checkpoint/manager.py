"""Distributed checkpointing (DCP): save and resume the whole training state under any layout.

A checkpoint is `{dump_folder}/{folder}/step-N` (see checkpoint_folders.py for the on-disk format). State is
keyed by parameter FQN (the model keeps its names when split or sharded), so DCP reshards it on load into
whatever layout the run has; values that are not tensors (data position, step, RNG) are the same on every rank
at a step boundary and DCP writes them once, from the coordinator rank.

Saving is synchronous or asynchronous: `async` copies ("stages") the state to fresh CPU memory, returns to
training, and writes in a background thread; `async_with_pinned_mem` stages into reused pinned host memory
(CUDA). At most one save is in flight; a folder is renamed from `.partial` only after its write finished.
"""

import hashlib
import io
import os
import shutil
import time
import tomllib
import warnings
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchtitan.tools import storage
from torchtitan.components.checkpoint import checksums
from torchtitan.components.checkpoint import folders
from torchtitan.components.checkpoint.hf_folder import load_hf_into, save_hf_folder
from torchtitan.config.job_config import JobConfig
from torchtitan.config.manager import to_toml
from torchtitan.protocols.state_dict_adapter import HFConfigMismatch
from torchtitan.tools.logging import logger
from torchtitan.tools.precision import DTYPES
from torchtitan.tools.restart import record_progress


RUN_RECORD = "run"  # on a store: the run's metrics.jsonl and resolved config.toml, beside the checkpoints

# DCP's CheckpointException derives from BaseException, so `except Exception` alone would miss it.
DCP_ERRORS = (Exception, dcp.CheckpointException)

# One process saves and loads without a process group on purpose; DCP would warn about it at every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the fix."""


# torch < 2.13's DefaultStager closes its StateDictStager after each stage, which empties its pinned-buffer
# cache and its copy dispatch table; a second stage then fails (KeyError: <class 'type'>; seen on an H200 with
# torch 2.11 at the second save). There each save gets a new stager; 2.13 keeps one across saves.
_STAGER_CLOSES_ITSELF = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _pinned_stager():
    """Stages GPU tensors into pinned host memory; the copies are synchronous so the training step only waits
    for the device-to-host copy, never for the write. Reused across saves (2.13+), so the pinned buffers are
    allocated once."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    return DefaultStager(StagingOptions(
        use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True))


class ModelWrapper(Stateful):
    """The model parts of this rank as one FQN-keyed state dict (pipeline parts hold disjoint keys); `part`
    "trainable" or "frozen" keeps only those parameters (a fine-tune on a frozen base saves the trainable ones)."""

    def __init__(self, model_parts: list[nn.Module], part: str = "all"):
        self.model_parts = model_parts
        self.part = part

    def state_dict(self) -> dict:
        sd = {}
        for m in self.model_parts:
            full = get_model_state_dict(m)
            if self.part != "all":
                keep = trainable_names(m) if self.part == "trainable" else set(full) - trainable_names(m)
                full = {k: v for k, v in full.items() if k in keep}
            sd.update(full)
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for m in self.model_parts:
            set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


class DataLoaderState(Stateful):
    """The position of the loader's global sample stream (datasets/packing.py), identical on every rank at a
    step boundary and free of any per-rank count, so it is saved once and loads under any data-parallel
    degree. The loader's own bookkeeping (batches yielded by this rank) is layout-bound and not saved; the
    trainer builds a fresh iterator after loading, which starts at the restored position."""

    def __init__(self, dataloader):
        self.dataset = dataloader.dataset

    def state_dict(self) -> dict:
        return {"position": self.dataset.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.dataset.load_state_dict(sd["position"])


class RNGState(Stateful):
    """torch's CPU (and CUDA) generator state. Every rank is seeded alike and draws alike, so the
    coordinator's copy, stored as one opaque blob, restores all ranks under any world size."""

    def state_dict(self) -> dict:
        states = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda"] = torch.cuda.get_rng_state()
        buf = io.BytesIO()
        torch.save(states, buf)
        return {"blob": buf.getvalue()}

    def load_state_dict(self, sd: dict) -> None:
        states = torch.load(io.BytesIO(sd["blob"]), weights_only=True)
        torch.set_rng_state(states["cpu"])
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state(states["cuda"])


def _state_dict_name(name: str) -> str:
    """A parameter's name as state dicts give it: without the compile and AC wrappers' prefixes."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def trainable_names(model: nn.Module) -> set[str]:
    return {_state_dict_name(n) for n, p in model.named_parameters() if p.requires_grad}


def has_frozen_base(model_parts: list[nn.Module]) -> bool:
    """Whether some parameters are frozen (e.g. a LoRA run): checkpoints then hold only the trainable ones and
    refer to the base by path and fingerprint, and the base is loaded again on resume."""
    return any(not p.requires_grad for m in model_parts for p in m.parameters())


def base_fingerprint(model_parts: list[nn.Module]) -> str:
    """sha256 over every frozen parameter's full value (name, dtype, shape, bytes): the same for the same base
    under any layout. Sharded parameters are gathered one at a time; pipeline stages' digests are combined
    over all ranks. Collective: every rank calls it."""
    digests = {}
    for m in model_parts:
        for name, t in ModelWrapper([m], "frozen").state_dict().items():
            full = t.full_tensor() if isinstance(t, DTensor) else t
            h = hashlib.sha256(f"{name} {full.dtype} {list(full.shape)}".encode())
            h.update(full.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digests[name] = h.hexdigest()
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, digests)
        digests = {k: v for d in everyone for k, v in d.items()}
    return hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(digests.items())).encode()).hexdigest()


def load_full_state_dict(model_parts: list[nn.Module], full_sd: dict, strict: bool = True) -> None:
    """Distributes a full (unsharded, identical on every rank) state dict into sharded model parts; `strict`
    False leaves the parameters it lacks as they are (a frozen base's adapters)."""
    for m in model_parts:
        keys = set(get_model_state_dict(m).keys())
        part = {k: v for k, v in full_sd.items() if k in keys}
        set_model_state_dict(m, part, options=StateDictOptions(full_state_dict=True, strict=strict))


def checkpoint_root(cfg: JobConfig) -> str:
    """`{dump_folder}/{folder}`, or `folder` itself when it is an object store URL (s3://bucket/run/ckpt)."""
    if storage.is_url(cfg.checkpoint.folder):
        return cfg.checkpoint.folder.rstrip("/")
    return os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)


def has_checkpoint(cfg: JobConfig) -> bool:
    return cfg.checkpoint.enable and bool(folders.named_steps(checkpoint_root(cfg)))


def check_shapes(source: str, saved: dict[str, torch.Size], expected: dict[str, torch.Size], *, exact: bool) -> None:
    """One clear line when a checkpoint does not fit the model (`exact`: it may not hold extra weights)."""
    hint = ("check --model.name, --model.flavor and --model.overrides (a run from before a flavor kept its own "
            "vocabulary trained the tokenizer's: --model.overrides vocab_size=N)")
    for key in sorted(set(expected) & set(saved)):
        if tuple(saved[key]) != tuple(expected[key]):
            raise CheckpointError(
                f"{source} was written for another model shape: {key} is {list(saved[key])} there, "
                f"{list(expected[key])} here; {hint}"
            )
    missing = sorted(set(expected) - set(saved))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} weight(s) of this model, e.g. {missing[0]}; {hint}")
    extra = sorted(set(saved) - set(expected))
    if exact and extra:
        raise CheckpointError(f"{source} holds {len(extra)} weight(s) this model lacks, e.g. {extra[0]}; {hint}")


def saved_optimizer(path: str) -> str | None:
    """The optimizer name in a checkpoint folder's config.toml; None when the folder has no readable one
    (a checkpoint from elsewhere)."""
    try:
        text = storage.read_bytes(storage.join(path, folders.CONFIG)).decode("utf-8")
        name = tomllib.loads(text).get("optimizer", {}).get("name")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return None
    return name if isinstance(name, str) else None


def read_dcp_metadata(path: str):
    try:
        return storage.dcp_reader(path).read_metadata()
    except DCP_ERRORS as e:  # a truncated or foreign .metadata raises pickle/EOF errors of many kinds
        raise CheckpointError(f"cannot read checkpoint {path}: {type(e).__name__}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    """The gist of an error; for DCP's wrapper, the first rank's underlying error."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        rank, cause = sorted(e.failures.items())[0]
        cause = cause[0] if isinstance(cause, tuple) else cause  # DCP keeps (exception, stack) pairs
        return f"rank {rank}: {type(cause).__name__}: {_first_line(cause)}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def finish_folder(
    partial: str, final: str, cfg: JobConfig | None, info: dict, written: dict[str, str] | None = None
) -> None:
    """Completes a written checkpoint (rank 0, after every rank's files are on disk): the resolved config (when
    there is one) and the manifest go beside the DCP files, with the checksums the ranks' writers recorded
    (`written`: the coordinator's own, e.g. `.metadata`), then the folder gets its final name atomically. On a
    store `partial` is `final`: the manifest, one PUT written last, is the commit; LATEST names it after."""
    sums = {**(written or {}), **checksums.collect_sidecars(partial)}
    if cfg is not None:
        text = to_toml(cfg).encode("utf-8")
        storage.write_bytes(storage.join(partial, folders.CONFIG), text)
        sums[folders.CONFIG] = checksums.format_checksum(zlib.crc32(text))
    folders.write_manifest(partial, info, sums)
    if partial != final:
        os.replace(partial, final)
    elif info.get("kind") == "full":
        root = final.rstrip("/").rsplit("/", 1)[0]
        storage.write_json(storage.join(root, folders.LATEST), {"step": info["step"]})


def content_problem(folder: str) -> str | None:
    """Why the files of a checkpoint whose sizes are right do not hold what was written (the manifest's
    checksums; a checkpoint of format 1 has none and passes), judged by every rank together, or None."""
    try:
        recorded = folders.read_manifest(folder).get("checksums")
    except (OSError, ValueError):
        return None  # no manifest (a checkpoint from elsewhere): folders.problem judged what can be judged
    return checksums.verify_share(folder, recorded) if recorded else None


def write_model_checkpoint(
    final: str, state_dict: dict[str, torch.Tensor], cfg: JobConfig | None, info: dict
) -> None:
    """A model-only checkpoint from one process (seed checkpoint, converted Hugging Face weights); `cfg` is
    the job it belongs to, None when the weights come from elsewhere."""
    if storage.exists(final):
        raise CheckpointError(f"{final} already exists; remove it or choose another output folder")
    partial = folders.partial_name(final)
    if not storage.is_url(final):
        os.makedirs(os.path.dirname(os.path.abspath(final)), exist_ok=True)
    writer = checksums.ChecksummingWriter(partial, rank=0)
    dcp.save({"model": state_dict}, checkpoint_id=partial, storage_writer=writer, no_dist=True)
    finish_folder(partial, final, cfg, {**info, "kind": "model"}, writer.metadata_checksums())


class _InFlight:
    def __init__(self, future, partial: str, final: str, info: dict, writer: checksums.ChecksummingWriter):
        self.future, self.partial, self.final, self.info, self.writer = future, partial, final, info, writer


class CheckpointManager:
    def __init__(
        self, cfg: JobConfig, *, model_parts, optimizers=None, lr_schedulers=None, dataloader=None, train_state=None,
        hf_adapter=None, model_args=None, tokenizer=None,
    ):
        """The state it saves and loads is what it is given: the trainer gives all of it; a model-only user
        (python -m torchtitan.eval) gives the model parts alone, and loads `initial_load_path` model-only."""
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.root = checkpoint_root(cfg)
        # With a frozen base (LoRA) a checkpoint holds the trainable parameters and refers to the base, which
        # is loaded from initial_load_path (or initialised) again on resume; exports hold every weight.
        self.frozen_base = has_frozen_base(model_parts)
        self.whole_model = ModelWrapper(model_parts)
        self.model = ModelWrapper(model_parts, "trainable") if self.frozen_base else self.whole_model
        self.base_model = ModelWrapper(model_parts, "frozen") if self.frozen_base else self.whole_model
        self.base_ref: dict | None = None  # {"path", "fingerprint"} of the base, once loaded
        self.model_parts = model_parts
        self.hf_adapter = hf_adapter
        self.model_args = model_args  # what an HF folder's config.json must describe (initial_load_in_hf)
        self.tokenizer = tokenizer  # written into Hugging Face folders the run saves
        self.states = {
            "model": self.model,
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": DataLoaderState(dataloader) if dataloader is not None else None,
            "train_state": train_state,
            "rng": RNGState() if train_state is not None else None,
        }
        self.states = {k: v for k, v in self.states.items() if v is not None}
        unknown = sorted(set(self.ckpt.exclude_from_loading) - set(self.states))
        if unknown:
            raise CheckpointError(
                f"--checkpoint.exclude_from_loading: unknown state {unknown[0]!r}; choose from {', '.join(self.states)}"
            )
        self.rank = _rank()
        self.last_blocking_s = 0.0  # how long the last save held up training (for benchmarks and logs)
        self._last_saved_step = -1
        self._in_flight: _InFlight | None = None
        self._reclaimer = folders.Reclaimer(self.root, folders.Retention(
            self.ckpt.keep_latest_k, self.ckpt.keep_every_n_steps, frozenset(self.ckpt.keep_steps)))
        self._async = self.ckpt.enable and self.ckpt.async_mode != "disabled"
        self._stager = None
        self._pg = None
        if not self._async:
            return
        if self.ckpt.async_mode == "async_with_pinned_mem":
            if not torch.cuda.is_available():
                raise CheckpointError(
                    "--checkpoint.async_mode async_with_pinned_mem stages GPU tensors into pinned host memory and "
                    "needs CUDA; on CPU use --checkpoint.async_mode async"
                )
            self._stager = _pinned_stager()
        if dist.is_initialized():
            # The background writer runs collectives (plan, finish) while training runs its own; a group of its
            # own keeps the two streams of collectives apart, and DCP needs a CPU backend (gloo) for them.
            self._pg = dist.new_group(backend="gloo")

    # ---- loading ----------------------------------------------------------------------------------------
    def load(self) -> bool:
        """Resumes from the run folder's checkpoint, else from initial_load_path; False when neither exists.
        With a frozen base, the base is loaded first and its fingerprint must be the one the checkpoint names."""
        if self.ckpt.enable:
            self._reclaimer.wait()  # a removal pass under way finishes before a folder is chosen (rollback)
            if self.rank == 0:
                self._reclaimer.recover(protect={self.ckpt.load_step})  # a removal a kill interrupted
            if dist.is_initialized():
                dist.barrier()
            step = self._resume_step()
            if step is not None:
                folder = folders.step_folder(self.root, step)
                if self.frozen_base:
                    self._load_base()
                    self._check_base(folder)
                self._load_dcp(folder, [k for k in self.states if k not in self.ckpt.exclude_from_loading])
                self._last_saved_step = step  # the loop does not save this step again
                if self.rank == 0:
                    record_progress(resumed_from=step)  # the supervisor's "made progress" baseline
                logger.info(f"Resumed from {folder}")
                return True
        if self.frozen_base:
            return self._load_base()
        return self._load_initial()

    def _load_base(self) -> bool:
        """The frozen base: initial_load_path's weights (or the model's own init), then its fingerprint."""
        loaded = self._load_initial()
        path = self.ckpt.initial_load_path
        where = os.path.abspath(path) if path else (
            f"{self.cfg.model.name} {self.cfg.model.flavor} initialised with seed {self.cfg.debug.seed}"
        )
        dtype = next(p.dtype for m in self.model_parts for p in m.parameters() if not p.requires_grad)
        self.base_ref = {
            "path": where, "fingerprint": base_fingerprint(self.model_parts), "dtype": str(dtype).removeprefix("torch.")
        }
        logger.info(f"Frozen base {where}: fingerprint {self.base_ref['fingerprint'][:16]}")
        return loaded

    def _check_base(self, folder: str) -> None:
        theirs = folders.read_manifest(folder).get("base")
        if theirs is None:
            raise CheckpointError(
                f"checkpoint {folder} holds a whole model, but this run freezes a base and trains adapters "
                f"(--model.converters {','.join(self.cfg.model.converters)}): resume it without them, or start "
                f"the fine-tune in a new --job.dump_folder"
            )
        if theirs["fingerprint"] != self.base_ref["fingerprint"]:
            raise CheckpointError(
                f"checkpoint {folder} was trained on base {theirs['path']} (fingerprint "
                f"{theirs['fingerprint'][:16]}) but this run's base {self.base_ref['path']} has fingerprint "
                f"{self.base_ref['fingerprint'][:16]}: resume with --checkpoint.initial_load_path {theirs['path']} "
                f"(and the same model options), or start a new --job.dump_folder"
            )

    def _load_initial(self) -> bool:
        path = self.ckpt.initial_load_path
        if not path:
            return False
        if not storage.isdir(path):
            raise CheckpointError(f"--checkpoint.initial_load_path {path}: no such folder")
        if self.ckpt.initial_load_in_hf:
            self._load_hf(path)
        else:
            why = folders.problem(path, require_manifest=False) or content_problem(path)
            if why is not None:
                raise CheckpointError(f"--checkpoint.initial_load_path {path}: {why}")
            keys = ["model"] if self.ckpt.initial_load_model_only or self.frozen_base else list(self.states)
            self._load_dcp(path, [k for k in keys if k not in self.ckpt.exclude_from_loading], model=self.base_model)
        logger.info(f"Loaded initial weights from {path}")
        return True

    def _resume_step(self) -> int | None:
        """The step to resume from; unusable folders are reported and left where they are."""
        partials = folders.leftovers(self.root, folders.PARTIAL)
        if partials and self.rank == 0:
            logger.warning(
                f"Ignoring unfinished checkpoint(s) {', '.join(partials)} in {self.root} (a save was interrupted); "
                f"left in place, a later save of the same step replaces it"
            )
        if self.ckpt.load_step >= 0:
            folder = folders.step_folder(self.root, self.ckpt.load_step)
            why = folders.problem(folder) or content_problem(folder)
            if why is not None:
                raise CheckpointError(f"--checkpoint.load_step {self.ckpt.load_step}: {folder} is not usable: {why}")
            return self.ckpt.load_step
        choice = folders.choose_resume_step(self.root, content_problem)
        newer = [f"{self.root}/{name}: {why}" for name, why in choice.skipped.items() if "newer torchtitan" in why]
        if newer:  # resuming an older step instead would redo (and later overwrite) the newer code's work
            raise CheckpointError(newer[0])
        if self.rank == 0:
            for name, why in choice.skipped.items():
                logger.warning(f"Skipping checkpoint {self.root}/{name}: {why}; left in place for inspection")
        if choice.step is None and choice.skipped:
            found = "; ".join(f"{name}: {why}" for name, why in choice.skipped.items())
            raise CheckpointError(
                f"no usable checkpoint in {self.root} ({found}); move the folder(s) away to start from scratch"
            )
        exports = folders.export_steps(self.root)
        if choice.step is None and exports and not self.ckpt.initial_load_path:
            # A finished run saved as an export only: starting over would silently redo (and overwrite) it,
            # and continuing from the weights alone changes the run (fresh optimizer, data from the start,
            # warmup again), so the user decides.
            export = folders.export_folder(self.root, exports[-1])
            raise CheckpointError(
                f"{self.root} holds only the model-only export {export} (no full checkpoint to extend the run "
                f"from); to continue from its weights with a fresh optimizer, data position and LR schedule, add "
                f"--checkpoint.initial_load_path {export} --checkpoint.initial_load_model_only, or move the folder "
                f"away to start over"
            )
        if choice.step is not None and exports and exports[-1] > choice.step and self.rank == 0:
            logger.warning(
                f"Resuming from step-{choice.step}: the newer export-step-{exports[-1]} holds weights only, so "
                f"steps {choice.step + 1}-{exports[-1]} are trained again"
            )
        return choice.step

    def _load_dcp(self, path: str, keys: list[str], model: ModelWrapper | None = None) -> None:
        """Loads `keys` of the training state from a DCP folder; `model` replaces the model state (the base
        alone, when a fine-tune starts from a whole-model checkpoint)."""
        states = {**self.states, "model": model or self.model}
        saved = read_dcp_metadata(path).state_dict_metadata
        for key in keys:
            if not any(k.startswith(key + ".") for k in saved):
                raise CheckpointError(
                    f"checkpoint {path} holds no {key!r} state (a model-only checkpoint?); load it with "
                    f"--checkpoint.initial_load_path {path} --checkpoint.initial_load_model_only, or add {key!r} "
                    f"to --checkpoint.exclude_from_loading"
                )
        if "optimizer" in keys:
            # Another optimizer's state fails deep inside DCP (missing keys), or, between Adam and AdamW whose
            # states look alike, loads silently into an optimizer that uses it differently.
            name, theirs = self.cfg.optimizer.name, saved_optimizer(path)
            if theirs is not None and theirs != name:
                raise CheckpointError(
                    f"checkpoint {path} holds {theirs} optimizer state but this run uses --optimizer.name {name}: "
                    f"set --optimizer.name {theirs} to continue the run, or add optimizer to "
                    f"--checkpoint.exclude_from_loading to keep the weights, data position and LR schedule and "
                    f"start {name} afresh"
                )
        if "model" in keys:
            saved_model = {k[len("model.") :]: m.size for k, m in saved.items() if k.startswith("model.")}
            whole_model = self.cfg.parallelism.pipeline_parallel_degree == 1  # a stage holds only some weights
            whole_model = whole_model and model is None  # a base is loaded from a checkpoint that may hold more
            expected = {k: v.shape for k, v in states["model"].state_dict().items()}  # DTensors: global shapes
            check_shapes(f"checkpoint {path}", saved_model, expected, exact=whole_model)
        try:
            dcp.load({k: states[k] for k in keys}, checkpoint_id=path, storage_reader=storage.dcp_reader(path),
                     no_dist=not dist.is_initialized())
        except DCP_ERRORS as e:  # DCP raises many types; the user needs the folder and the cause
            raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {_first_line(e)}") from e

    def _load_hf(self, path: str) -> None:
        if self.hf_adapter is None:
            raise CheckpointError(f"model {self.cfg.model.name} has no Hugging Face adapter; cannot load {path}")
        if not storage.isfile(storage.join(path, "config.json")):
            raise CheckpointError(f"--checkpoint.initial_load_path {path}: not a Hugging Face folder (no config.json)")
        try:
            # The folder's config must describe the model trained (a same-shaped model with another rope
            # theta would load silently); then each rank reads only the slices of the tensors it holds.
            self.hf_adapter.check_hf_config(path, self.hf_adapter.args_from_hf(path), self.model_args)
            load_hf_into(self.base_model.state_dict(), path, self.hf_adapter(self.model_args))
        except HFConfigMismatch as e:  # another model: its one line names the settings
            raise CheckpointError(str(e)) from e
        except Exception as e:  # safetensors / json errors of many kinds
            raise CheckpointError(
                f"cannot read Hugging Face checkpoint {path}: {type(e).__name__}: {_first_line(e)}"
            ) from e

    # ---- saving -----------------------------------------------------------------------------------------
    def save(self, step: int, *, last: bool = False, force: bool = False) -> None:
        """Saves the full state at the interval, when forced (preemption) and at the last step, where
        `last_save` may add (or, export_only, write instead) the model-only export. A step is saved at most once."""
        if not self.ckpt.enable:
            return
        self._poll()
        if step == self._last_saved_step:
            return
        hf_every = self.ckpt.hf_interval > 0 and step % self.ckpt.hf_interval == 0
        if last:
            choice = self.ckpt.last_save
            full, export = choice not in ("export_only", "hf_only"), choice in ("full_and_export", "export_only")
            hf = choice in ("full_and_hf", "hf_only") or hf_every
        else:
            full, export, hf = force or step % self.ckpt.interval == 0, False, hf_every
        if not (full or export or hf):
            return
        if full:
            self._write(folders.step_folder(self.root, step), self.states, step, "full")
        if hf:
            self._write_hf(step)
        if export:
            dtype = DTYPES[self.ckpt.export_dtype]
            model = {k: v.to(dtype) for k, v in self.whole_model.state_dict().items()}
            self._write(folders.export_folder(self.root, step), {"model": model}, step, "export")
        self._last_saved_step = step

    def _write_hf(self, step: int) -> None:
        """A Hub-ready Hugging Face folder `hf-step-N`, written by every rank from its own shards
        (hf_folder.save_hf_folder), under a .partial name until complete; on a store under its own name, its
        config.json (written last) marking it complete."""
        if self.hf_adapter is None:
            raise CheckpointError(f"--checkpoint.last_save {self.ckpt.last_save}: model {self.cfg.model.name} has no Hugging Face adapter")
        self.wait()
        final = storage.join(self.root, f"hf-step-{step}")
        partial = folders.partial_name(final)
        if self.rank == 0:
            self._clear_name(partial, final, marker="config.json")
        if dist.is_initialized():
            dist.barrier()
        try:
            save_hf_folder(self.model.state_dict(), self.hf_adapter, self.model_args, partial,
                           dtype=DTYPES[self.ckpt.export_dtype], max_shard_bytes=self.ckpt.hf_max_shard_mb * 10**6,
                           tokenizer=self.tokenizer)
        except DCP_ERRORS as e:
            raise CheckpointError(f"save of {final} failed: {type(e).__name__}: {_first_line(e)}") from e
        if self.rank == 0:
            if partial != final:
                os.replace(partial, final)
            logger.info(f"Saved Hugging Face folder {final} (loads with transformers' from_pretrained)")

    def _write(self, final: str, states: dict, step: int, kind: str) -> None:
        t0 = time.perf_counter()
        self.wait()  # at most one save in flight
        partial = folders.partial_name(final)
        if self.rank == 0:
            self._clear_name(partial, final)
        if dist.is_initialized():
            dist.barrier()  # nobody writes into the folder before rank 0 cleared it
        info = {"step": step, "kind": kind, "world_size": dist.get_world_size() if dist.is_initialized() else 1}
        writer = checksums.ChecksummingWriter(partial, self.rank)  # hashes each file as it is written
        if self.base_ref is not None and kind == "full":
            info["base"] = self.base_ref  # what the adapters were trained on; resume checks it
        if self._async:
            # The state dicts, not the Stateful objects: a stager given the objects (torch versions that stage
            # before converting them) would deep-copy the objects themselves, model included.
            plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in states.items()}
            future = dcp.async_save(plain, checkpoint_id=partial, storage_writer=writer, process_group=self._pg,
                                    async_stager=self._stager)
            if self._stager is not None and _STAGER_CLOSES_ITSELF:
                self._stager = _pinned_stager()  # torch < 2.13 emptied this one after its stage: a new one
            self._in_flight = _InFlight(future, partial, final, {**info, "mode": self.ckpt.async_mode}, writer)
            self.last_blocking_s = time.perf_counter() - t0
            logger.info(f"Checkpoint {final}: staged in {self.last_blocking_s:.2f}s, writing in the background")
        else:
            try:
                dcp.save(states, checkpoint_id=partial, storage_writer=writer, no_dist=not dist.is_initialized())
            except DCP_ERRORS as e:  # e.g. a full disk: this save fails, the complete checkpoints stay
                raise CheckpointError(
                    f"save of {final} failed: {type(e).__name__}: {_first_line(e)}; {partial} is left for inspection"
                ) from e
            self._finish(partial, final, {**info, "mode": "sync"}, writer)
            self.last_blocking_s = time.perf_counter() - t0

    def _clear_name(self, partial: str, final: str, marker: str = folders.MANIFEST) -> None:
        """Makes room for a new save of this step; nothing usable is deleted. On a store, `marker` is the file
        whose presence makes the folder complete (the manifest; config.json for a Hugging Face folder)."""
        if storage.is_url(final):
            # No rename on a store: an unfinished save of this step (no manifest) is deleted; a complete one (an
            # earlier run's, e.g. refused as corrupt) is copied aside server-side, then its manifest deleted
            # first, so that no moment shows two complete copies under step names or none at all.
            if storage.isfile(storage.join(final, marker)):
                aside = f"{final}.old-{time.strftime('%Y%m%d-%H%M%S')}"
                logger.warning(f"{final} exists (an earlier run's save of this step); copying it to {aside}")
                storage.copy_tree(final, aside)
                storage.remove(storage.join(final, marker))
            if storage.isdir(final):
                logger.warning(f"Replacing {final}, the unfinished save of an interrupted run")
                storage.remove_tree(final)
            return
        if os.path.exists(partial):
            logger.warning(f"Replacing {partial}, the unfinished save of an interrupted run")
            shutil.rmtree(partial)
        if os.path.exists(final):
            aside = f"{final}.old-{time.strftime('%Y%m%d-%H%M%S')}"
            logger.warning(f"{final} exists (an earlier run's save of this step); moving it to {aside}")
            os.replace(final, aside)

    def _finish(self, partial: str, final: str, info: dict, writer: checksums.ChecksummingWriter) -> None:
        if self.rank == 0:
            finish_folder(partial, final, self.cfg, info, writer.metadata_checksums())
            if info["kind"] == "full":
                logger.info(f"Saved checkpoint {final}")
                record_progress(saved=info["step"])
                self._mirror_run_record()
                self._reclaimer.start(protect={info["step"]})
            else:
                logger.info(f"Saved model-only export {final} (weights for generation and conversion; not resumable)")

    def _mirror_run_record(self) -> None:
        """On a store, the run folder's record (metrics.jsonl, the resolved config.toml and, when enabled, the
        TensorBoard event files) is copied beside the checkpoints (`{root}/run/`) at every save, so it outlives
        the nodes; a failure here is only a warning. TensorBoard writes locally: its own S3 support is boto3's
        (not this storage layer: no retries, credentials of its own) and, with no append on a store, it would
        rewrite the whole event file at every flush."""
        if not storage.is_url(self.root):
            return
        dump = self.cfg.job.dump_folder
        names = ["metrics.jsonl", "config.toml"]
        tb = self.cfg.metrics.save_tb_folder
        if self.cfg.metrics.enable_tensorboard and os.path.isdir(os.path.join(dump, tb)):
            names += [os.path.join(tb, rel) for rel in sorted(storage.file_sizes(os.path.join(dump, tb)))]
        for name in names:
            local = os.path.join(dump, name)
            if os.path.isfile(local):
                try:
                    storage.upload_file(local, storage.join(self.root, RUN_RECORD, *name.split(os.sep)))
                except OSError as e:
                    logger.warning(f"Could not copy {local} to {self.root}/{RUN_RECORD}/: {e}")

    def _poll(self) -> None:
        """Completes a background save that has finished, so it becomes visible (and survives a kill) early."""
        if self._in_flight is not None and self._in_flight.future.done():
            self.wait()

    def wait(self) -> None:
        """Blocks until the save in flight (if any) is written, then completes its folder."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        try:
            job.future.result()
        except DCP_ERRORS as e:
            raise CheckpointError(
                f"background save of {job.final} failed: {type(e).__name__}: {_first_line(e)}; "
                f"{job.partial} is left for inspection"
            ) from e
        self._finish(job.partial, job.final, job.info, job.writer)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._reclaimer.wait()
            if self._stager is not None:
                self._stager.close()
