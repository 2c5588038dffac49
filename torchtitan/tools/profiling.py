"""torch.profiler traces and CUDA memory snapshots, every `profile_freq` steps."""

import os
import pickle

import torch

from torchtitan.config.job_config import Profiling
from torchtitan.tools.logging import logger


class Profiler:
    """A context around the training loop; call `step(step)` after every training step. Traces and
    snapshots land under `{dump_folder}/{save_traces_folder}`."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device):
        self.cfg, self.rank, self.device = cfg, rank, device
        self.folder = os.path.join(dump_folder, cfg.save_traces_folder)
        self._prof = None
        if cfg.enable_profiling or cfg.enable_memory_snapshot:
            os.makedirs(self.folder, exist_ok=True)
        if cfg.enable_profiling:
            freq = max(cfg.profile_freq, 2)
            self._prof = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=freq - 2, warmup=1, active=1),
                on_trace_ready=self._save_trace,
            )
            self._prof.start()
        if cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def _save_trace(self, prof) -> None:
        path = os.path.join(self.folder, f"rank{self.rank}_step{self._step}.json")
        prof.export_chrome_trace(path)
        logger.info(f"Profiler trace saved to {path}")

    def step(self, step: int) -> None:
        self._step = step
        if self._prof is not None:
            self._prof.step()
        if self.cfg.enable_memory_snapshot and step % self.cfg.profile_freq == 0:
            path = os.path.join(self.folder, f"memory_snapshot_rank{self.rank}_step{step}.pickle")
            with open(path, "wb") as f:
                pickle.dump(torch.cuda.memory._snapshot(), f)

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self.cfg.enable_memory_snapshot:
            torch.cuda.memory._record_memory_history(enabled=None)
