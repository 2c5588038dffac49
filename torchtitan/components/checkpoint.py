"""Distributed checkpointing (DCP): save and resume the whole training state under any layout.

A checkpoint is `{dump_folder}/{folder}/step-N`, written first as `step-N.partial` and renamed when every
rank has finished, so a folder named step-N is always complete. State is keyed by parameter FQN (the model
keeps its names when split or sharded), so DCP reshards it on load into whatever layout the run has.
"""

import os
import re
import shutil

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

from torchtitan.config.job_config import JobConfig
from torchtitan.tools.logging import logger

STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the folder and the fix."""


class ModelWrapper(Stateful):
    """The model parts of this rank as one FQN-keyed state dict (pipeline parts hold disjoint keys)."""

    def __init__(self, model_parts: list[nn.Module]):
        self.model_parts = model_parts

    def state_dict(self) -> dict:
        sd = {}
        for m in self.model_parts:
            sd.update(get_model_state_dict(m))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        for m in self.model_parts:
            set_model_state_dict(m, sd, options=StateDictOptions(strict=False))


def load_full_state_dict(model_parts: list[nn.Module], full_sd: dict) -> None:
    """Distributes a full (unsharded, identical on every rank) state dict into sharded model parts."""
    for m in model_parts:
        keys = set(get_model_state_dict(m).keys())
        part = {k: v for k, v in full_sd.items() if k in keys}
        set_model_state_dict(m, part, options=StateDictOptions(full_state_dict=True, strict=True))


def checkpoint_root(cfg: JobConfig) -> str:
    return os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)


def complete_steps(root: str) -> list[int]:
    """Steps with a complete checkpoint folder (partial ones carry a different name)."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def has_checkpoint(cfg: JobConfig) -> bool:
    return cfg.checkpoint.enable and bool(complete_steps(checkpoint_root(cfg)))


class CheckpointManager:
    def __init__(self, cfg: JobConfig, *, model_parts, optimizers, lr_schedulers, dataloader, train_state):
        self.cfg = cfg
        self.ckpt = cfg.checkpoint
        self.root = checkpoint_root(cfg)
        self.model = ModelWrapper(model_parts)
        self.states = {
            "model": self.model,
            "optimizer": optimizers,
            "lr_scheduler": lr_schedulers,
            "dataloader": dataloader,
            "train_state": train_state,
        }

    # ---- loading ----------------------------------------------------------------------------------------
    def load(self) -> bool:
        """Resumes from the run folder's checkpoint, else from initial_load_path; False when neither exists."""
        if self.ckpt.enable and complete_steps(self.root):
            steps = complete_steps(self.root)
            step = steps[-1] if self.ckpt.load_step < 0 else self.ckpt.load_step
            if step not in steps:
                raise CheckpointError(
                    f"--checkpoint.load_step {step}: no complete checkpoint in {self.root} (have {steps})"
                )
            keys = [k for k in self.states if k not in self.ckpt.exclude_from_loading]
            self._load(os.path.join(self.root, f"step-{step}"), keys)
            logger.info(f"Resumed from {self.root}/step-{step}")
            return True
        if self.ckpt.initial_load_path:
            path = self.ckpt.initial_load_path
            if not os.path.isfile(os.path.join(path, ".metadata")):
                raise CheckpointError(f"--checkpoint.initial_load_path {path}: not a complete DCP checkpoint")
            keys = ["model"] if self.ckpt.initial_load_model_only else list(self.states)
            self._load(path, keys)
            logger.info(f"Loaded initial weights from {path}")
            return True
        return False

    def _load(self, path: str, keys: list[str]) -> None:
        states = {k: self.states[k] for k in keys}
        try:
            dcp.load(states, checkpoint_id=path)
        except Exception as e:  # DCP raises many types; the user needs the folder and the cause
            raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from e

    # ---- saving -----------------------------------------------------------------------------------------
    def save(self, step: int, *, last: bool = False) -> None:
        if not self.ckpt.enable or not (last or step % self.ckpt.interval == 0):
            return
        self.save_to(os.path.join(self.root, f"step-{step}"), model_only=False)

    def save_to(self, final: str, *, model_only: bool) -> None:
        partial = final + ".partial"
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        states = {"model": self.model} if model_only else self.states
        dcp.save(states, checkpoint_id=partial)
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(partial, final)
            logger.info(f"Saved checkpoint {final}")
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        pass
