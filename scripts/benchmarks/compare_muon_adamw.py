"""Muon vs AdamW at equal steps: train the same recipe twice (same seed, data, LR schedule) and print both
loss curves and their final training and validation losses.

    python scripts/benchmarks/compare_muon_adamw.py [--config train_configs/debug_model.toml] [--steps 100]
                                         [--out ./outputs/muon_vs_adamw] [-- extra trainer overrides]

Each run is the real trainer (`torchtitan.train.main`) on one process, with the recipe's precision; only
--optimizer.name differs, so Muon uses the recipe's learning rate and weight decay (its update is scaled to
AdamW's RMS, see docs/optimizers.md). A loss comparison, not a timing.
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout, not an installed copy

from torchtitan.train import main as train_main


def _read(folder: str) -> tuple[list[tuple[int, float]], float | None]:
    train, val = [], None
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        for m in map(json.loads, f):
            if "loss" in m:
                train.append((m["step"], m["loss"]))
            if "validation/loss" in m:
                val = m["validation/loss"]
    return train, val


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="train_configs/debug_model.toml")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="./outputs/muon_vs_adamw")
    p.add_argument("overrides", nargs="*", help="extra trainer arguments, after --")
    args = p.parse_args()

    results = {}
    for name in ("AdamW", "Muon"):
        folder = os.path.join(args.out, name)
        if os.path.exists(os.path.join(folder, "metrics.jsonl")):
            os.remove(os.path.join(folder, "metrics.jsonl"))
        rc = train_main(["--job.config_file", args.config, "--training.steps", str(args.steps),
                         "--optimizer.name", name, "--job.dump_folder", folder, *args.overrides])
        if rc != 0:
            print(f"{name} run failed (exit {rc})", file=sys.stderr)
            return rc
        results[name] = _read(folder)

    steps = [s for s, _ in results["AdamW"][0]]
    print(f"\n{'step':>5}  {'AdamW':>8}  {'Muon':>8}")
    for (s, a), (_, m) in zip(results["AdamW"][0], results["Muon"][0]):
        print(f"{s:>5}  {a:8.4f}  {m:8.4f}")
    for name, (train, val) in results.items():
        val_text = f"{val:.4f}" if val is not None else "n/a"
        print(f"{name:>5}: final train loss {train[-1][1]:.4f} at step {steps[-1]}, final validation loss {val_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
