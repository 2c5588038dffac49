"""Runs one training command N times and counts the runs that die by a signal (issue 31: one run in eight of
`NGPU=2 ./run_train.sh --parallelism.context_parallel_degree 2 --training.steps 3 --training.seq_len 128
--training.local_batch_size 4` died with SIGABRT in a rank on a loaded 2-core machine).

    python scripts/diagnostics/cp_abort_loop.py --runs 50                # the issue's command, 50 times
    python scripts/diagnostics/cp_abort_loop.py --runs 5 -- --training.steps 2 --parallelism.context_parallel_degree 2
    python scripts/diagnostics/cp_abort_loop.py --runs 10 --starve-gloo-workers   # the loaded machine, exaggerated

Every rank's output is kept (LOG_RANK=all ranks) with Python's faulthandler on (a fatal signal prints every
thread's Python stack) and TORCH_SHOW_CPP_STACKTRACES=1 (C++ frames in torch's errors); the log of a run that
failed is kept under --out and its signal lines and stacks are printed; its dump folder keeps every rank's
stderr in ranks/rank-N.stderr (tools/rank_stderr.py), whichever rank died. On CUDA, --comm.trace_buf_size turns
on NCCL's flight recorder as well (gloo has none). Prints one line per run and a summary:
`runs N, ok K, aborted (SIGABRT) A, other failures F`.

--starve-gloo-workers reproduces what a loaded machine does to the ranks, deterministically enough to count:
busy processes take every core, and gloo's worker threads (`pt_gloo_runloop`) of every rank are put on
SCHED_IDLE, so they run only when a core is free. A worker that completed a collective is then late to drop its
reference to the collective's tensors; if a rank's process group is still alive when the interpreter exits
(it was, before distributed/utils.end_distributed), that drop lands while Python finalizes and the thread dies
in std::terminate: `terminate called without an active exception`, SIGABRT (see docs/context_parallel.md).
"""

import argparse
import os
import re
import subprocess
import sys
import threading
import time

ISSUE_ARGS = ["--parallelism.context_parallel_degree", "2", "--training.steps", "3", "--training.seq_len", "128",
              "--training.local_batch_size", "4"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _starve_gloo_workers(stop: threading.Event) -> None:
    """Puts every training rank's gloo worker threads on SCHED_IDLE as soon as they appear."""
    from gloo_exit_probe import starve, thread_ids  # this script's folder is on sys.path

    done: set[int] = set()
    while not stop.wait(0.02):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if b"torchtitan.train" not in open(f"/proc/{pid}/cmdline", "rb").read():
                    continue
                for tid in set(thread_ids(int(pid), "pt_gloo_runloop")) - done:
                    starve(tid)
                    done.add(tid)
            except OSError:  # the process or thread ended while looking
                pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--ngpu", type=int, default=2)
    parser.add_argument("--out", default="/tmp/cp_abort_loop", help="folder for the logs of failed runs")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before one run counts as hung")
    parser.add_argument("--starve-gloo-workers", action="store_true",
                        help="busy processes on every core and the ranks' gloo worker threads on SCHED_IDLE")
    parser.add_argument("args", nargs="*", help="trainer arguments (default: the issue's CP 2 command)")
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    env = dict(os.environ, NGPU=str(opts.ngpu), LOG_RANK=",".join(map(str, range(opts.ngpu))),
               PYTHONFAULTHANDLER="1", TORCH_SHOW_CPP_STACKTRACES="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = opts.args or ISSUE_ARGS
    counts = {"ok": 0, "aborted": 0, "other": 0}
    stop, busy = threading.Event(), []
    if opts.starve_gloo_workers:
        from gloo_exit_probe import busy_processes

        busy = busy_processes(os.cpu_count() or 2)
        threading.Thread(target=_starve_gloo_workers, args=(stop,), daemon=True).start()
    try:
        return _loop(opts, env, args, counts)
    finally:
        stop.set()
        for b in busy:
            b.kill()


def _loop(opts, env: dict, args: list[str], counts: dict) -> int:
    for i in range(opts.runs):
        t0 = time.time()
        dump = os.path.join(opts.out, f"run-{i}")
        cmd = [os.path.join(ROOT, "run_train.sh"), *args, "--job.dump_folder", dump]
        try:
            p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=opts.timeout)
            rc, log = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        signal_lines = [l for l in log.splitlines() if re.search(r"Signal \d+|SIGABRT|Fatal Python error|exitcode\s*:\s*-", l)]
        kind = "ok" if rc == 0 else ("aborted" if any("Signal 6" in l or "SIGABRT" in l or "Aborted" in l
                                                       or "exitcode  : -6" in l for l in signal_lines) else "other")
        counts[kind] += 1
        print(f"run {i + 1}/{opts.runs}: rc {rc}, {kind}, {time.time() - t0:.0f}s", flush=True)
        if kind != "ok":
            path = os.path.join(opts.out, f"run-{i}.log")
            with open(path, "w") as f:
                f.write(log)
            print(f"  log: {path}; each rank's stderr (stacks, C/C++ messages): {dump}/ranks/", flush=True)
            for line in signal_lines[:10]:
                print(f"  {line}", flush=True)
            stack = log[log.find("Fatal Python error"):][:3000] if "Fatal Python error" in log else ""
            if stack:
                print(stack, flush=True)
        else:
            subprocess.run(["rm", "-rf", dump])
    print(f"runs {opts.runs}, ok {counts['ok']}, aborted (SIGABRT) {counts['aborted']}, "
          f"other failures {counts['other']}")
    return 0 if counts["ok"] == opts.runs else 1


if __name__ == "__main__":
    sys.exit(main())
