"""Memory budget on this CPU: the planned runs against no AC and full AC, measured.

    python scripts/benchmarks/bench_memory_budget.py [--flavor debugmodel] [--layers 16] [--seq-len 512]
                                          [--batch 16] [--steps 2] [--offload-dir DIR]

1. Measures the file tier's bandwidth (256 MiB written and read back through the offload's own code).
2. Trains no AC and full AC, each in a fresh process (the real entry point, torchtitan.train.main; fp32,
   deterministic, the same batches, every run with --memory.cpu_return_freed).
3. The runtime the estimator does not model (torch's libraries, the data loader, thread pools): measured in
   the no-AC run after its last optimizer step, when no activation is alive, as its RSS less the parameters,
   gradients and optimizer state the estimator counts. Every prediction is the planner's figure + this runtime,
   and a budget is met when the run measures <= budget + runtime.
4. Picks three budgets: A, halfway between full AC and no AC (no AC does not fit: recompute where it is
   cheapest); B, below full AC's MEASURED peak (halfway between it and the least plan of the blocks): only
   activation offload (offload, full_offload per block) meets it, and the planner asked without them must
   refuse; C, below the least plan of the blocks (only offloading the optimizer state as well meets it). Trains
   each in a fresh process.
Per run it prints the training memory measured = peak RSS - the RSS of the process before the trainer started
(the interpreter: not what a budget is for), its median step time (steps 2..N) and its ratio to full AC's, the
predicted peak and whether its losses equal no AC's bitwise. Run it with the machine otherwise idle for the
step times (run it with the machine otherwise idle); it prints the load average before and after.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

GIB = 2**30


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(argv: list[str]) -> None:
    """In a fresh process: train with `argv`, print a JSON line of what was measured."""
    baseline = _rss()
    from torch.optim.optimizer import register_optimizer_step_post_hook

    after_step = []  # RSS after each optimizer step: no activation alive then
    register_optimizer_step_post_hook(lambda *_: after_step.append(_rss()))
    from torchtitan.train import main

    code = main(argv)
    # VmHWM, the high-water mark of this process's own memory: ru_maxrss would carry over the parent's RSS at
    # fork (the bench's 0.78 GiB after its tier measurement), a floor under every run that needs less.
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    folder = argv[argv.index("--job.dump_folder") + 1]
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    steps = [m for m in steps if "loss" in m]
    tokens = steps[1]["tokens_seen"] - steps[0]["tokens_seen"] if len(steps) > 1 else 0
    times = [tokens / m["tps"] for m in steps[1:] if m.get("tps")]
    print("RESULT " + json.dumps({"code": code, "baseline": baseline, "peak": peak,
                                  "after_step": after_step[-1] if after_step else None,
                                  "losses": [m["loss"] for m in steps],
                                  "step_s": statistics.median(times) if times else None}), flush=True)


def _child(argv: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", json.dumps(argv)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    plan = [line.split("memory plan", 1)[1] for line in (out.stdout + out.stderr).splitlines() if "memory plan" in line]
    plan = ["memory plan" + p for p in plan]
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            result["plan"] = plan[0] if plan else ""
            return result
    raise RuntimeError(f"run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--layers", type=int, default=16, help="transformer blocks (--model.overrides n_layers)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--offload-dir", default="")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one is not None:
        run_one(json.loads(a.one))
        return 0

    from torchtitan.distributed.activation_offload import measure_file_bandwidth
    from torchtitan.job_plan import plan_job
    from torchtitan.planning.memory_budget import _inputs, least_budget, plan_budget
    from torchtitan.planning.step_time import DEFAULT_MFU
    from torchtitan.protocols.train_spec import config_manager

    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    offload_dir = a.offload_dir or tempfile.gettempdir()
    write, read = measure_file_bandwidth(offload_dir)
    gbps = min(write, read) / 1e9
    print(f"file tier in {offload_dir}: write {write / 1e9:.2f} GB/s, read {read / 1e9:.2f} GB/s "
          f"(planner uses {gbps:.2f})")
    work = tempfile.mkdtemp(prefix="bench-memory-budget-")
    # Every run returns freed memory to the OS (a fixed glibc mmap threshold, as a budget's plan sets): the
    # comparison is of what each keeps alive, not of what glibc's heap happens to retain.
    common = ["--model.flavor", a.flavor, "--model.overrides", f"n_layers={a.layers}",
              "--training.seq_len", str(a.seq_len), "--training.local_batch_size",
              str(a.batch), "--training.steps", str(a.steps), "--training.mixed_precision_param", "float32",
              "--metrics.log_freq", "1", "--debug.seed", "7", "--debug.deterministic", "--memory.cpu_return_freed",
              "--memory.offload_dir", offload_dir, "--memory.offload_bandwidth_gbps", f"{gbps:.3f}"]
    blocks_only = ["--memory.plan_choices", "keep,op,full,offload,full_offload"]

    def parse(extra: list[str]):
        cfg = config_manager().parse_args(common + ["--job.dump_folder", work] + extra)
        return cfg, plan_job(cfg, 1)

    def predicted(extra: list[str]) -> int:
        return plan_budget(*parse(extra)).memory.peak

    def least(extra: list[str]) -> int:
        return least_budget(*parse(["--memory.budget_gib", "1000"] + extra))

    def run(name: str, extra: list[str]) -> dict:
        r = _child(common + ["--job.dump_folder", os.path.join(work, name.replace(" ", "_"))] + extra)
        print(f"  {name}: done, load average {os.getloadavg()[0]:.1f}", flush=True)
        return r

    keep = predicted(["--memory.budget_gib", "1000", "--memory.plan_choices", "keep"])
    full = predicted(["--memory.budget_gib", "1000", "--memory.plan_choices", "full"])
    least_blocks, least_all = least(blocks_only), least([])
    results = {"no AC": run("no AC", []), "full AC": run("full AC", ["--activation_checkpoint.mode", "full"])}
    # What the estimator does not model: the no-AC run's RSS after its last optimizer step (no activation
    # alive) less the parameters, gradients and optimizer state it counts.
    state = _inputs(*parse(["--memory.budget_gib", "1000"]), 1e11, None, DEFAULT_MFU).state  # (flops: unused here)
    ref = results["no AC"]
    runtime = ref["after_step"] - ref["baseline"] - (state.params + state.grads + state.optimizer + state.buffers)
    full_measured = results["full AC"]["peak"] - results["full AC"]["baseline"]
    budget_a = (full + keep) / 2
    budget_b = least_blocks + 0.5 * (full_measured - runtime - least_blocks)
    if budget_b <= least_blocks:  # a shape too small: full AC measured no more than offload's least plan
        print("full AC measured below the least plan of the blocks: budget B cannot show offload (a larger shape)")
        budget_b = least_blocks * 1.001
    budget_c = least_all + 0.5 * (least_blocks - least_all)
    print(f"runtime beyond the estimator (no-AC run after its optimizer step): {runtime / GIB:.3f} GiB")
    print(f"predicted training memory: no AC {keep / GIB:.3f} GiB, full AC {full / GIB:.3f} GiB, least plan of the "
          f"blocks {least_blocks / GIB:.3f} GiB, least with the optimizer state offloaded {least_all / GIB:.3f} GiB; "
          f"full AC measured {full_measured / GIB:.3f} GiB = {(full_measured - runtime) / GIB:.3f} + runtime; "
          f"budgets A {budget_a / GIB:.3f}, B {budget_b / GIB:.3f}, C {budget_c / GIB:.3f} GiB")
    cfg, plan = parse(["--memory.budget_gib", f"{budget_b / GIB:.4f}", "--memory.plan_choices", "keep,op,full"])
    try:
        plan_budget(cfg, plan)
        print("budget B without offload: met (unexpected)")
    except ValueError as e:
        print(f"budget B without offload: refused: {e}")

    for name, extra in {
        "budget A": ["--memory.budget_gib", f"{budget_a / GIB:.4f}"],
        "budget B": ["--memory.budget_gib", f"{budget_b / GIB:.4f}"] + blocks_only,
        "budget C": ["--memory.budget_gib", f"{budget_c / GIB:.4f}"],
    }.items():
        results[name] = run(name, extra)
    ref = results["no AC"]["losses"]
    print(f"{'run':<10} {'budget GiB':>10} {'predicted GiB':>13} {'measured GiB':>12} {'pred/meas':>9} "
          f"{'meas/(budget+runtime)':>21} {'step s':>7} {'vs full AC':>10} {'losses == no AC':>15}")
    for name, r in results.items():
        budget = {"budget A": budget_a, "budget B": budget_b, "budget C": budget_c}.get(name)
        pred = {"no AC": keep, "full AC": full}.get(name)
        if budget is not None:
            pred = float(r["plan"].split("predicted peak ")[1].split(" GiB")[0]) * GIB
        pred += runtime
        measured = r["peak"] - r["baseline"]
        within = f"{measured / (budget + runtime):.3f}" if budget else "-"
        print(f"{name:<10} {budget / GIB if budget else float('nan'):>10.3f} {pred / GIB:>13.3f} "
              f"{measured / GIB:>12.3f} {pred / measured:>9.3f} {within:>21} {r['step_s']:>7.2f} "
              f"{r['step_s'] / results['full AC']['step_s']:>10.3f} {str(r['losses'] == ref):>15}")
    print(f"budget B + runtime = {(budget_b + runtime) / GIB:.3f} GiB vs full AC measured "
          f"{full_measured / GIB:.3f} GiB")
    for name in ("budget A", "budget B", "budget C"):
        print(f"{name}: {results[name]['plan']}")
    print(f"load average after: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
