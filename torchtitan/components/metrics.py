"""Training metrics: a JSON-lines file, the console, TensorBoard and Weights & Biases.

`{dump_folder}/metrics.jsonl` is the record of truth: one object per `log` call, flushed at once so a crashed run
keeps every line it logged. A resumed run appends, so steps after its checkpoint may appear twice; readers keep
the last occurrence. Non-finite values are written as NaN/Infinity (Python's json reads them back) because a
NaN loss is exactly what the log must show.
"""

import json
import os
from typing import Any

from torchtitan.config.job_config import Metrics as MetricsConfig
from torchtitan.tools.logging import logger


def throughput_metrics(tokens: int, seconds: float, flops_per_token: float, peak_flops: float) -> dict[str, float]:
    """Per-device throughput over a log window.

    `tokens` are those this device processed in the window, `flops_per_token` the model's training FLOPs per
    token (forward + backward), `peak_flops` the device's peak FLOP/s. MFU is in % and deliberately not clamped:
    above 100% means the peak is wrong or the FLOP count too high, and hiding that would hide the bug; such a
    window also gets `mfu_above_100 = 1`, so a reader of metrics.jsonl can tell without knowing the rule.
    """
    tps = tokens / seconds
    achieved_flops = tps * flops_per_token
    metrics = {"tps": tps, "tflops": achieved_flops / 1e12, "mfu": 100.0 * achieved_flops / peak_flops}
    if metrics["mfu"] > 100.0:
        metrics["mfu_above_100"] = 1.0
    return metrics


def mfu_above_100_warning(metrics: dict[str, float]) -> str:
    """Why an MFU above 100% cannot be true, with the figures of the window that showed it."""
    peak = metrics["tflops"] * 100.0 / metrics["mfu"]
    return (
        f"MFU {metrics['mfu']:.0f}% is impossible: the model achieved {metrics['tflops']:.3g} TFLOP/s but the peak "
        f"it is divided by is {peak:.3g} TFLOP/s, so that peak is wrong (a measured CPU peak taken with a slower "
        f"kernel or dtype than the model's linears run, or a datasheet entry for another device); MFU values are "
        f"flagged mfu_above_100 in metrics.jsonl"
    )


_COLORS = {
    "red": "\033[31m",
    "green": "\033[32m",
    "yellow": "\033[33m",
    "blue": "\033[34m",
    "magenta": "\033[35m",
    "cyan": "\033[36m",
    "reset": "\033[39m",
}
_NO_COLORS = dict.fromkeys(_COLORS, "")

# Keys the console line formats itself; everything else is appended as key=value.
_CONSOLE_KEYS = ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "data_loading_pct")


def _memory_text(metrics: dict[str, float]) -> str | None:
    if "memory/max_reserved_gib" in metrics:
        text = f"{metrics['memory/max_reserved_gib']:.2f}GiB"
        if "memory/max_reserved_pct" in metrics:
            text += f"({metrics['memory/max_reserved_pct']:.1f}%)"
        return text
    if "memory/peak_rss_gib" in metrics:
        return f"{metrics['memory/peak_rss_gib']:.2f}GiB rss"
    return None


def format_console_line(step: int, metrics: dict[str, float], color: bool) -> str:
    """`step:  10  loss:  7.1234  grad_norm:  1.2345  lr: 8.0e-04  memory: 1.20GiB(1.5%)  tps: 12,345 ...`"""
    c = _COLORS if color else _NO_COLORS
    parts = [f"{c['red']}step: {step:3d}"]
    if "loss" in metrics:
        parts.append(f"{c['green']}loss: {metrics['loss']:7.4f}")
    if "grad_norm" in metrics:
        parts.append(f"grad_norm: {metrics['grad_norm']:7.4f}")
    if "lr" in metrics:
        parts.append(f"lr: {metrics['lr']:.1e}")
    memory = _memory_text(metrics)
    if memory is not None:
        parts.append(f"{c['yellow']}memory: {memory}")
    if "tps" in metrics:
        parts.append(f"{c['blue']}tps: {metrics['tps']:,.0f}")
    if "tflops" in metrics:
        parts.append(f"{c['cyan']}tflops: {metrics['tflops']:,.2f}")
    if "mfu" in metrics:
        parts.append(f"{c['magenta']}mfu: {metrics['mfu']:.2f}%")
    if "data_loading_pct" in metrics:
        parts.append(f"{c['reset']}data: {metrics['data_loading_pct']:.1f}%")
    others = [
        f"{key}={value:.5g}"
        for key, value in metrics.items()
        if key not in _CONSOLE_KEYS and not key.startswith("memory/")
    ]
    if others:
        parts.append(f"{c['reset']}" + "  ".join(others))
    return "  ".join(parts) + c["reset"]


class MetricsLogger:
    """Writes each `log(step, metrics)` call to every enabled sink of this rank.

    With `rank_0_only` (the default) ranks other than 0 write and print nothing. Otherwise every rank prints and
    writes its own `metrics_rank{N}.jsonl` (rank 0 keeps `metrics.jsonl`) and TensorBoard folder
    `{save_tb_folder}/rank_{N}`, since ranks appending to one file would interleave. Weights & Biases is fed by rank
    0 only either way: one job is one W&B run.
    """

    def __init__(
        self, dump_folder: str, cfg: MetricsConfig, rank: int, config_dict: dict[str, Any] | None = None
    ) -> None:
        self.enabled = rank == 0 or not cfg.rank_0_only
        self.color = not cfg.disable_color_printing
        self._jsonl = None
        self._tb_writer = None
        self._wandb_run = None
        self._warned_mfu = False
        if not self.enabled:
            return
        os.makedirs(dump_folder, exist_ok=True)
        jsonl_name = "metrics.jsonl" if rank == 0 else f"metrics_rank{rank}.jsonl"
        self._jsonl = open(os.path.join(dump_folder, jsonl_name), "a")
        if cfg.enable_tensorboard:
            # Imported only when enabled: tensorboard takes seconds to import.
            from torch.utils.tensorboard import SummaryWriter

            tb_dir = os.path.join(dump_folder, cfg.save_tb_folder)
            if not cfg.rank_0_only:
                tb_dir = os.path.join(tb_dir, f"rank_{rank}")
            self._tb_writer = SummaryWriter(log_dir=tb_dir)
            logger.info(f"TensorBoard logs in {tb_dir}")
        if cfg.enable_wandb and rank == 0:
            import wandb

            self._wandb_run = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "torchtitan"), dir=dump_folder, config=config_dict
            )
            logger.info(f"Weights & Biases run in {self._wandb_run.dir}")

    def log(self, step: int, metrics: dict[str, float], console: bool = True) -> None:
        """One metrics.jsonl row (and TensorBoard / W&B values); `console` False when the caller logs its own
        line about it (a guard event)."""
        if not self.enabled:
            return
        values = {key: float(value) for key, value in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
        self._jsonl.flush()
        if console:
            logger.info(format_console_line(step, values, self.color))
        if values.get("mfu_above_100") and not self._warned_mfu:
            logger.warning(mfu_above_100_warning(values))
            self._warned_mfu = True
        if self._tb_writer is not None:
            for key, value in values.items():
                self._tb_writer.add_scalar(key, value, step)
            self._tb_writer.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(values, step=step)

    def close(self) -> None:
        self.enabled = False
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb_writer is not None:
            self._tb_writer.close()
            self._tb_writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None
