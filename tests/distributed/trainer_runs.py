"""Run the real Trainer on N gloo ranks and read back what a user would read (metrics.jsonl).

Shared by the parity tests: one tiny fp32 recipe, one seed, one global batch; only the layout changes.
"""

import json
import os

import torch

from tests.multiprocess import run_ranks

# fp32, deterministic, the same global batch of 8 sequences per step for every layout.
PARITY_ARGS = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "64",
    "--training.global_batch_size", "8",
    "--training.steps", "10",
    "--training.mixed_precision_param", "float32",
    "--optimizer.lr", "3e-2",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--debug.seed", "7",
    "--debug.deterministic",
]


# Document masking with per-document RoPE positions: the layout parity tests run once more with these.
DOCUMENT_MASKING = ["--training.document_masking", "--training.document_positions"]


def read_metrics(dump_folder: str) -> list[dict]:
    with open(os.path.join(dump_folder, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _train(rank, world_size, argv, dump_folder, probe, setup):
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    if setup is not None:
        setup(rank, world_size)
    cfg = config_manager().parse_args(PARITY_ARGS + argv + ["--job.dump_folder", dump_folder])
    trainer = Trainer(cfg)
    try:
        trainer.train()
        extra = probe(trainer) if probe is not None else None
    finally:
        trainer.close()
    return extra


def train(world_size: int, argv: list[str], dump_folder: str, probe=None, setup=None,
          timeout: float = 600.0) -> tuple[list[dict], list]:
    """Trains on `world_size` ranks; returns (rank 0's logged steps, each rank's probe(trainer) result).

    setup(rank, world_size) runs on each rank before the trainer is built (e.g. to break a feature on
    purpose); probe(trainer) runs after training and its result is returned per rank. `timeout`: seconds to
    wait for a rank's result (a hang fails the call)."""
    extras = run_ranks(_train, world_size, argv, dump_folder, probe, setup, timeout=timeout)
    steps = [m for m in read_metrics(dump_folder) if "loss" in m]
    return steps, extras


def curves(steps: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([m["loss"] for m in steps], dtype=torch.float64),
            torch.tensor([m["grad_norm"] for m in steps], dtype=torch.float64))
