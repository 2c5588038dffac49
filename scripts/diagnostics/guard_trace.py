"""The spike guard on clean runs of the shipped recipes: does it ever call a healthy curve a spike, at any window
from the smallest it accepts to the default? And does it still catch a 1e4x gradient at every window?

    python scripts/diagnostics/guard_trace.py                                  # the six debug recipes, 200 steps
    python scripts/diagnostics/guard_trace.py --steps 200 --configs train_configs/debug_model.toml train_configs/qwen3_debug.toml
    python scripts/diagnostics/guard_trace.py --metrics a/metrics.jsonl b/metrics.jsonl  # replay finished runs' logs instead
    python scripts/diagnostics/guard_trace.py --configs train_configs/qwen3_debug.toml --out /tmp/trace -- --training.seq_len 64
    python scripts/diagnostics/guard_trace.py --metrics run/metrics.jsonl --save curves.json  # keep the curves (tests/unit/guard_curves.json)

Each recipe trains once, guard off, one process (`--metrics.log_freq 1`, validation off; extra trainer
arguments after `--`; `--out` keeps each run's folder, `{out}/{recipe}/metrics.jsonl`). Its per-step loss and
gradient norm are then replayed through the guard's decision (components/faults/step_guard.py: `replay` and
`missed_spikes`, the function the trainer's guard calls) at every window: while no event has happened the
guard's history is exactly those values, so the first event it reports is the one the trainer would have acted
on. Prints, per window, the events on the clean run (there should be none), and at how many of the judged steps
a 1e4x gradient norm injected there would be missed (each step probed against the history the clean run had
there). Exit status 1 if a clean run has an event or an injection is missed.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from torchtitan.components.faults.step_guard import MIN_WINDOW, missed_spikes, replay  # noqa: E402
from torchtitan.config.job_config import Guard  # noqa: E402

# The shipped recipes a CPU runs: the others need a Hub tokenizer (assets/hf/...) and the c4 dataset.
RECIPES = ["train_configs/debug_model.toml", "train_configs/qwen3_debug.toml", "train_configs/debug_moe.toml",
           "train_configs/gpt_oss_debug.toml", "train_configs/qwen3_debug_lora.toml",
           "train_configs/qwen3_debug_sft.toml"]


def clean_run(config: str, steps: int, folder: str, extra: list[str]) -> list[tuple[int, float, float]]:
    cmd = [sys.executable, "-m", "torchtitan.train", "--job.config_file", config, "--training.steps", str(steps),
           "--metrics.log_freq", "1", "--validation.enable", "false", "--checkpoint.enable", "false",
           "--parallelism.expert_parallel_degree", "1", "--job.dump_folder", folder, *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return read(os.path.join(folder, "metrics.jsonl"))


def read(path: str) -> list[tuple[int, float, float]]:
    """[(step, loss, grad_norm)] of a metrics.jsonl, the last logged value of each step (a rollback logs again)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    last = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows if "loss" in r and "grad_norm" in r}
    return [(s, *last[s]) for s in sorted(last)]


def save(path: str, curves: dict[str, tuple[str, list[tuple[int, float, float]]]]) -> None:
    """{name: {"command": ..., "curve": [[step, loss, grad_norm], ...]}}, a step a line (readable diffs)."""
    parts = [f" {json.dumps(name)}: {{\"command\": {json.dumps(command)}, \"curve\": [\n"
             + ",\n".join(f"  {json.dumps(list(row))}" for row in series) + "\n ]}"
             for name, (command, series) in curves.items()]
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(parts) + "\n}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=RECIPES)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--metrics", nargs="+", help="replay these metrics.jsonl files instead of training")
    parser.add_argument("--out", help="keep each run's folder here (default: a temporary folder)")
    parser.add_argument("--save", help="write the curves here as JSON {name: {command, curve: [[step, loss, "
                        "grad_norm], ...]}}, the form of tests/unit/guard_curves.json")
    parser.add_argument("--threshold", type=float, default=Guard.threshold)
    parser.add_argument("--max-window", type=int, default=Guard.window)
    parser.add_argument("extra", nargs="*", help="trainer arguments for every run")
    opts = parser.parse_args()
    runs, commands = {}, {}
    if opts.metrics:
        runs = {path: read(path) for path in opts.metrics}
    else:
        for config in opts.configs:
            commands[config] = " ".join(["--job.config_file", config, "--training.steps", str(opts.steps), *opts.extra])
            if opts.out:
                folder = os.path.join(opts.out, os.path.splitext(os.path.basename(config))[0])
                runs[config] = clean_run(config, opts.steps, folder, opts.extra)
                continue
            with tempfile.TemporaryDirectory() as folder:
                runs[config] = clean_run(config, opts.steps, folder, opts.extra)
    if opts.save:
        save(opts.save, {name: (commands.get(name, f"the metrics.jsonl {name}"), series) for name, series in runs.items()})
    bad = 0
    for name, series in runs.items():
        print(f"{name}: {len(series)} steps, grad norm {series[0][2]:.3g} .. max {max(s[2] for s in series):.3g}, "
              f"loss {series[0][1]:.3g} -> {series[-1][1]:.3g}")
        for window in range(MIN_WINDOW, opts.max_window + 1):
            cfg = Guard(enable=True, window=window, threshold=opts.threshold)
            events, missed = replay(series, cfg), missed_spikes(series, cfg)
            bad += len(events) + len(missed)
            shown = "; ".join(e.describe() for e in events[:3]) or "none"
            print(f"  window {window:2d}: clean events {len(events)} ({shown}); a 1e4x grad norm at each of the "
                  f"{len(series) - window} judged steps: missed at {len(missed)}{' ' + str(missed[:5]) if missed else ''}")
    print("OK: no event on the clean runs, every injection caught" if not bad else f"FAILED: {bad} problem(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
