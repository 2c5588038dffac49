"""Causes of a rank's SIGABRT outside gloo's point-to-point path, tried one at a time (issue 31; the gloo
scenarios are scripts/diagnostics/gloo_p2p_probe.py). Each scenario is a fresh process (with tools/rank_stderr.py's
capture, as a rank has) whose end is printed: `ok`, an exit code, or the signal, with the first C/C++ line it wrote.

    python scripts/diagnostics/abort_causes_probe.py                  # every scenario
    python scripts/diagnostics/abort_causes_probe.py mallopt_under_threads

- mallopt_under_threads: glibc heap corruption ("free(): invalid pointer" is a SIGABRT) from the allocator
  settings tools/cpu_malloc.py makes with mallopt after the process group's threads exist: 4 threads allocate,
  fill, check and free torch tensors of 64 KiB to 16 MiB (THP_MEM_ALLOC_ENABLE=1, as a CPU rank) while the main
  thread switches between the three settings (return freed, keep freed, glibc's defaults) 20,000 times.
- daemon_thread_in_store_call_at_exit: a daemon thread blocked inside a C++ call (a TCPStore wait, the GIL
  released) while the interpreter exits: the hang watch's thread if it were not joined (Python ends such a
  thread with pthread_exit, whose unwinding through a noexcept C++ frame would be std::terminate).
- store_gone_under_watch: the hang watch's loop on a TCPStore whose server process dies (torchrun's agent
  leaving first).
- exit_without_destroy: a rank that leaves with its gloo group alive after a collective (a trainer that raised
  before close): the group's destructor at interpreter exit.
- crafted_bad_free: the control: glibc's own abort, to show what such a death prints and that it reaches the
  log (tests/unit/test_rank_stderr.py checks the same).
"""

import os
import subprocess
import sys
import tempfile
import time

SCENARIOS = ["mallopt_under_threads", "daemon_thread_in_store_call_at_exit", "store_gone_under_watch",
             "exit_without_destroy", "crafted_bad_free"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scenario_main(name: str, folder: str) -> None:
    from torchtitan.tools import rank_stderr

    rank_stderr.capture(folder, 0)
    import threading

    import torch
    import torch.distributed as dist

    if name == "mallopt_under_threads":
        stop = threading.Event()

        def churn(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            while not stop.is_set():
                n = int(torch.randint(16 * 2**10, 4 * 2**20, (1,), generator=g))  # 64 KiB .. 16 MiB of float32
                t = torch.full((n,), float(seed))
                assert t[-1].item() == seed and t.sum().item() == seed * n
                del t

        threads = [threading.Thread(target=churn, args=(i + 1,)) for i in range(4)]
        for t in threads:
            t.start()
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
        for i in range(20_000):  # cpu_malloc's three settings, by its own mallopt calls
            if i % 3 == 0:  # return_freed_memory: a fixed 128 KiB mmap threshold
                mallopt(-3, 128 * 1024)
            elif i % 3 == 1:  # keep_freed_memory: no mmap, no trimming
                mallopt(-4, 0), mallopt(-1, 2**31 - 1)
            else:  # back to mmap and trimming at glibc's defaults
                mallopt(-4, 65536), mallopt(-1, 128 * 1024)
        stop.set()
        for t in threads:
            t.join()
    elif name == "daemon_thread_in_store_call_at_exit":
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, is_master=True, wait_for_workers=False)
        threading.Thread(target=lambda: store.wait(["never"]), daemon=True).start()
        time.sleep(1.0)  # the thread is inside the C++ wait; the interpreter exits under it
    elif name == "store_gone_under_watch":
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                                   f"s = d.TCPStore('127.0.0.1', {port}, 2, is_master=True); time.sleep(3)"])
        time.sleep(2.0)
        client = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
        ended = []

        def watch() -> None:  # distributed/hang_watch.py's loop: any exception ends the watch, never the rank
            try:
                while True:
                    client.add("alarms", 0)
                    time.sleep(0.1)
            except Exception as e:  # noqa: BLE001
                ended.append(type(e).__name__)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        server.wait()
        t.join(timeout=60)
        assert ended, "the watch did not notice the store going away"
    elif name == "exit_without_destroy":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        x = torch.ones(1024)
        dist.all_reduce(x)
        dist.barrier()  # then a plain interpreter exit, the group never destroyed
    elif name == "crafted_bad_free":
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.free.argtypes = [ctypes.c_void_p]
        buf = ctypes.create_string_buffer(64)
        libc.free(ctypes.addressof(buf) + 16)


def run(name: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               THP_MEM_ALLOC_ENABLE="1")
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--scenario", name, folder], env=env, capture_output=True,
                               text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return "hung (killed after 300 s)"
        with open(os.path.join(folder, "ranks", "rank-0.stderr")) as f:
            logged = f.read()
    lines = [line for line in logged.splitlines() if line.strip()]
    native = next((line.strip() for line in lines if "terminate called" in line or "free(" in line
                   or "malloc" in line or "corrupt" in line or "Fatal Python error" in line), "")
    took = f"{time.time() - t0:.1f}s"
    if p.returncode < 0:
        return f"killed by signal {-p.returncode} ({native[:160]}), {took}"
    if p.returncode:
        return f"exit {p.returncode}: {(lines[-1] if lines else '')[:160]}, {took}"
    return f"ok, {took}"


def main() -> int:
    if sys.argv[1:2] == ["--scenario"]:
        scenario_main(sys.argv[2], sys.argv[3])
        return 0
    for name in sys.argv[1:] or SCENARIOS:
        print(f"{name}: {run(name)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
