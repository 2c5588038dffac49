"""A tiny one-process training run and file inventories, shared by the checkpoint unit tests."""

import json
import os

from torchtitan.train import main

TINY = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.global_batch_size", "4",
    "--training.local_batch_size", "4",
    "--training.mixed_precision_param", "float32",
    "--lr_scheduler.warmup_steps", "1",
    "--metrics.log_freq", "1",
]


def run(folder, *argv) -> int:
    return main(TINY + ["--job.dump_folder", str(folder), *argv])


def losses(folder) -> list[float]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [m["loss"] for m in map(json.loads, f) if "loss" in m]


RUN_OUTPUTS = {"config.toml", "metrics.jsonl"}  # what every run (re)writes at the top of its dump folder


def inventory(folder) -> dict[str, int]:
    """Every file under `folder` but the run outputs, with its size: equal before and after a refused run
    means it deleted or changed nothing."""
    out = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, folder)] = os.path.getsize(path)
    return {k: v for k, v in out.items() if k not in RUN_OUTPUTS}
