"""A rank that exits with its gloo process group alive can die of SIGABRT after a clean run (issue 31's abort).

    python scripts/diagnostics/gloo_exit_probe.py                    # 20 runs of 2 ranks, each way
    python scripts/diagnostics/gloo_exit_probe.py --runs 50 --ways group_alive

Each run starts two fresh ranks (gloo over loopback) that do a few all-reduces of temporary tensors and exit 0.
gloo runs a collective on a worker thread (`pt_gloo_runloop`), which keeps the collective's tensors until it has
finished its loop iteration, after the main thread was already told the result. When Python has dropped a
tensor first, the worker's release is the last one and it must take the GIL to free the tensor's Python object.
If that happens while the interpreter finalizes, Python 3.11-3.13 ends the thread with pthread_exit, whose
unwinding through torch's noexcept destructor is std::terminate: `terminate called without an active
exception`, SIGABRT. It needs the worker to be late, which a loaded machine makes it: here busy processes take
every core and the workers are put on SCHED_IDLE (they run only when a core is free).

Ways (the rank code is the same up to its last lines):
- group_alive: exit with the process group alive, as every rank of the trainer did until torch's DTensor caches
  were let go of (distributed/utils.end_distributed): a share of ranks die of SIGABRT.
- group_ended: destroy the group and collect before exiting (what end_distributed does): the workers finish and
  are joined while the interpreter is whole; no abort.

Prints each failed rank's last stderr line and `N runs x 2 ranks, <way>: exit codes {code: count}`.
"""

import argparse
import os
import socket
import subprocess
import sys

WAYS = ["group_alive", "group_ended"]


def thread_ids(pid: int, name: str) -> list[int]:
    """Ids of process `pid`'s threads called `name` (their comm)."""
    task = f"/proc/{pid}/task"
    ids = []
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                if f.read().strip() == name:
                    ids.append(int(tid))
        except OSError:  # the thread ended while listing
            pass
    return ids


def starve(tid: int) -> None:
    """Thread `tid` runs only when a core is free (SCHED_IDLE)."""
    os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))


def busy_processes(n: int) -> list[subprocess.Popen]:
    """`n` processes spinning on a core each (kill them when done)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def rank_main(rank: int, port: int, way: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    dist.all_reduce(torch.ones(4))  # the group's worker threads exist from here
    for tid in thread_ids(os.getpid(), "pt_gloo_runloop"):
        starve(tid)
    for _ in range(3):
        x = torch.ones(1024)
        dist.all_reduce(x)
        assert x[0].item() == 2
        del x  # Python's last reference: the worker may still hold the tensor
    if way == "group_ended":
        import gc

        dist.destroy_process_group()
        gc.collect()
    sys.exit(0)


def run(way: str, runs: int) -> dict:
    codes: dict = {}
    for i in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(port), way],
                                  stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        for r, p in enumerate(ranks):
            err = p.communicate(timeout=300)[1]
            codes[p.returncode] = codes.get(p.returncode, 0) + 1
            if p.returncode != 0:
                last = [line for line in err.splitlines() if line.strip()][-1:] or [""]
                print(f"  {way} run {i}, rank {r}: exit code {p.returncode}: {last[0]}", flush=True)
    return codes


def main() -> int:
    if sys.argv[1:2] == ["--rank"]:
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {WAYS}")
    parser.add_argument("--busy", type=int, default=(os.cpu_count() or 2) + 1, help="busy processes")
    opts = parser.parse_args()
    busy = busy_processes(opts.busy)
    try:
        for way in opts.ways.split(","):
            codes = run(way, opts.runs)
            print(f"{opts.runs} runs x 2 ranks, {way}: exit codes {codes}", flush=True)
    finally:
        for b in busy:
            b.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
