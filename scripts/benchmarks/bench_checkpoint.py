"""Checkpoint cost, one process on CPU: save time, time the training step is blocked, load time, size.

    python scripts/benchmarks/bench_checkpoint.py [--models debugmodel,cpu_medium] [--repeats 3] [--folder /tmp/ckpt-bench]

For each model the real Trainer is built (model, AdamW state, data position, LR schedule, RNG) and one step is
trained; then, per mode, the full training state is saved `repeats` times:
  blocked  time the training loop is held up by save() (sync: the whole write; async: staging the copy)
  total    save() until the checkpoint folder is complete (async: + the background write)
  step+    extra time of the training step that runs while an async write is in flight (CPU contention)
  load     resuming from the checkpoint (DCP read into the live model/optimizer)
Prints a Markdown table (medians). `cpu_medium` is a ~50M-parameter Llama shape registered by this script.
"""

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from torchtitan.components.checkpoint.manager import CheckpointManager  # noqa: E402
from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.protocols.train_spec import config_manager
from torchtitan.models.llama3.flavors import llama3_flavors  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

llama3_flavors.setdefault(
    "cpu_medium", dataclasses.replace(llama3_flavors["debugmodel"], dim=768, n_layers=8, n_heads=12, n_kv_heads=4)
)


def manager(trainer: Trainer, cfg) -> CheckpointManager:
    return CheckpointManager(
        cfg,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        dataloader=trainer.dataloader,
        train_state=trainer.train_state,
    )


def folder_size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path) for f in names)


def bench(model: str, repeats: int, root: str) -> list[dict]:
    base = [
        "--model.flavor", model, "--training.seq_len", "128", "--training.local_batch_size", "2",
        "--training.mixed_precision_param", "float32", "--checkpoint.enable", "--job.dump_folder", root,
    ]
    trainer = Trainer(config_manager().parse_args(base))
    data = [iter(trainer.dataloader)]

    def step() -> float:
        batches = trainer._next_microbatches(data[0])
        t0 = time.perf_counter()
        trainer.train_step(batches)
        return time.perf_counter() - t0

    step()
    baseline = statistics.median(step() for _ in range(3))
    rows = []
    for mode in ("disabled", "async"):
        cfg = config_manager().parse_args(base + ["--checkpoint.async_mode", mode, "--checkpoint.keep_latest_k", "0"])
        m = manager(trainer, cfg)
        blocked, total, extra, loads = [], [], [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            m.save(100 * (i + 1) + (0 if mode == "disabled" else 50), force=True)
            blocked.append(m.last_blocking_s)
            if mode == "async":
                written = []
                m._in_flight.future.add_done_callback(lambda _: written.append(time.perf_counter()))
                extra.append(step() - baseline)  # a training step overlapping the background write
                m.wait()
                total.append(written[0] - t0)
            else:
                total.append(time.perf_counter() - t0)
            load_cfg = config_manager().parse_args(base + ["--checkpoint.load_step", str(m._last_saved_step)])
            t0 = time.perf_counter()
            manager(trainer, load_cfg).load()
            loads.append(time.perf_counter() - t0)
            data[0] = iter(trainer.dataloader)  # as the trainer does: a fresh iterator after loading
        m.close()
        path = os.path.join(root, "checkpoint", f"step-{m._last_saved_step}")
        rows.append({
            "model": model, "params": trainer.num_params, "mode": "sync" if mode == "disabled" else mode,
            "size_mb": folder_size(path) / 2**20, "step_s": baseline, "blocked_s": statistics.median(blocked),
            "total_s": statistics.median(total), "step_extra_s": statistics.median(extra) if extra else 0.0,
            "load_s": statistics.median(loads),
        })
    trainer.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="debugmodel,cpu_medium")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--folder", default="/tmp/ckpt-bench")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    for model in args.models.split(","):
        shutil.rmtree(args.folder, ignore_errors=True)
        rows += bench(model, args.repeats, args.folder)
    shutil.rmtree(args.folder, ignore_errors=True)
    print("| model | params | mode | checkpoint MB | train step s | blocked s | save total s | step slowdown s "
          "| load s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['mode']} | {r['size_mb']:.0f} | {r['step_s']:.3f} | "
              f"{r['blocked_s']:.3f} | {r['total_s']:.3f} | {r['step_extra_s']:+.3f} | {r['load_s']:.3f} |")


if __name__ == "__main__":
    main()
