"""Hang diagnosis: name the collective every rank is in and the ranks that never arrived, long before the
process-group timeout fires the same anonymous error on every rank.

Every collective a rank issues through `torch.distributed` or its functional collectives (DTensor, FSDP, the
trainer's reductions, DCP) gets a per-group sequence number. A watcher thread on each rank publishes its
counters to the job's TCPStore (a side channel that works while the process group is stuck) whenever they
changed. A rank that has issued nothing for `hang_timeout_seconds` reads the counters of its last collective's
group: the ranks whose count is lower have not arrived. It logs one report naming the collective
(`#seq name` on its group) and those ranks, and raises an alarm in the store; on the alarm every rank dumps its
Python stack (all threads, faulthandler) to `{dump_folder}/hang/rank-N.txt` and logs where it is.

Compiled code: a wrapper that dynamo traces (MoE's expert-parallel all-to-all inside a compiled block) counts
nothing. Traced, its bookkeeping would run once at trace time, never when the graph runs (and dynamo cannot
enter its lock); dynamo turns the collective itself into a functional one in the graph. Collectives inside
compiled graphs are thus uncounted on every rank alike, so the counts still agree; a rank stuck in one is
judged by the last collective before the graph (FSDP's all-gather of the block, at the latest) and its stack
dump names the frame. (Counting them as they run would take a side-effect op inside the graph; tried with
torch 2.13, inductor then freed a buffer of the MoE inference graph before its last use.)

Limits: "the collective it waits in" is the last one a rank issued (a rank blocked in a wait issues nothing
more; with prefetching FSDP it may be one ahead: the stack dump shows the exact frame). On CUDA, the NCCL flight
recorder (--comm.trace_buf_size) records the collectives as NCCL saw them and dumps them on a timeout.
"""

import faulthandler
import functools
import inspect
import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torchtitan.tools.logging import logger

_DIST_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
             "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "all_to_all",
             "all_to_all_single", "gather", "gather_object", "scatter", "reduce", "batch_isend_irecv")
_FUNCOL_OPS = ("all_reduce", "all_gather_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor",
               "reduce_scatter_tensor_autograd", "all_to_all_single", "all_to_all_single_autograd", "broadcast",
               "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced",
               # torch 2.13's names (the *_tensor ones above are their deprecated aliases and call the plain
               # all_gather_single / reduce_scatter_single, left unwrapped so that nothing counts twice)
               "all_gather_single_autograd", "reduce_scatter_single_autograd")


class CollectiveLog:
    """What this rank issued: a count per group, and the last collective (group, seq, name, wall time)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: dict[str, int] = {}
        self.last: tuple[str, int, str, float] | None = None

    def issued(self, group: str, name: str) -> None:
        with self.lock:
            seq = self.counts.get(group, 0) + 1
            self.counts[group] = seq
            self.last = (group, seq, name, time.time())

    def snapshot(self) -> dict:
        with self.lock:
            return {"counts": dict(self.counts), "last": self.last}


LOG = CollectiveLog()
_installed = False


def _group_name(group) -> str:
    if group is None:
        group = dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group.group_name
    return funcol._resolve_group_name(group)  # (mesh, dim), a mesh, ranks or a name


def _wrap(module, name: str, kind: str) -> None:
    real = getattr(module, name, None)
    if real is None or getattr(real, "_hang_watch", False):
        return
    params = list(inspect.signature(real).parameters)
    group_index = params.index("group") if "group" in params else None

    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # traced, not run: see "Compiled code" in the module docstring
            return real(*args, **kwargs)
        group = kwargs.get("group")
        if group is None and group_index is not None and len(args) > group_index:
            group = args[group_index]
        try:
            LOG.issued(_group_name(group), f"{kind}.{name}")
        except Exception:  # never let bookkeeping break a collective
            pass
        return real(*args, **kwargs)

    wrapper._hang_watch = True
    setattr(module, name, wrapper)


def install_collective_log() -> None:
    """Counts every collective this process issues (idempotent; cheap: a lock and a dict update)."""
    global _installed
    if _installed:
        return
    for name in _DIST_OPS:
        _wrap(dist, name, "dist")
    for name in _FUNCOL_OPS:
        _wrap(funcol, name, "funcol")
    _installed = True


def enable_flight_recorder(trace_buf_size: int, dump_folder: str) -> None:
    """NCCL's flight recorder: the last `trace_buf_size` collectives per rank, dumped to
    {dump_folder}/comm_traces/rank_N when a collective times out. Must run before the process group starts."""
    if trace_buf_size <= 0:
        return
    folder = os.path.join(os.path.abspath(dump_folder), "comm_traces")
    os.makedirs(folder, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(trace_buf_size))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", os.path.join(folder, "rank_"))


def _store() -> dist.Store:
    """A client connection of its own to the job's TCPStore (the one torchrun or rank 0 hosts)."""
    client = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30)
    )
    return dist.PrefixStore(f"torchtitan/hang_watch/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/", client)


class HangWatch:
    """The watcher thread of one rank (start after the process group is up; close before it is destroyed)."""

    def __init__(self, timeout_s: float, dump_folder: str, rank: int, poll_s: float | None = None):
        install_collective_log()
        self.timeout_s, self.rank = timeout_s, rank
        self.poll_s = poll_s if poll_s is not None else min(1.0, timeout_s / 4)
        self.folder = os.path.join(dump_folder, "hang")
        self.reports: list[str] = []  # what this rank logged (for tests and post-mortems)
        self._store = _store()
        self._stop = threading.Event()
        self._published = None
        self._reported: set = set()
        self._alarms_seen = 0
        self._thread = threading.Thread(target=self._run, name="hang-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except Exception as e:  # the store went away (job ending): stop watching, never crash the rank
                logger.debug(f"hang watch stopped: {e}")
                return

    def _tick(self) -> None:
        state = LOG.snapshot()
        if state != self._published:
            self._store.set(f"rank/{self.rank}", json.dumps(state))
            self._published = state
        alarms = int(self._store.add("alarms", 0))
        if alarms > self._alarms_seen:
            self._alarms_seen = alarms
            self._on_alarm(json.loads(self._store.get(f"alarm/{alarms}")), state)
        last = state["last"]
        if last is None or time.time() - last[3] < self.timeout_s or tuple(last[:2]) in self._reported:
            return
        group, seq, name, since = last
        ranks = dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(group))
        others = {}
        for r in ranks:
            if r != self.rank and self._store.check([f"rank/{r}"]):
                others[r] = json.loads(self._store.get(f"rank/{r}"))
        behind = sorted(r for r in ranks if r != self.rank and others.get(r, {"counts": {}})["counts"].get(group, 0) < seq)
        if not behind:
            return  # everyone reached it: a long computation, not a hang
        self._reported.add((group, seq))
        where = "; ".join(self._describe(r, others.get(r), group) for r in behind)
        report = (f"hang: rank {self.rank} has waited {time.time() - since:.0f}s in collective #{seq} {name} "
                  f"on group {group} (ranks {_span(ranks)}); not arrived: rank(s) {', '.join(map(str, behind))} "
                  f"({where}); stacks in {self.folder}/rank-N.txt")
        alarm = int(self._store.add("alarms", 1))
        self._store.set(f"alarm/{alarm}", json.dumps({"report": report, "group": group, "seq": seq}))

    @staticmethod
    def _describe(rank: int, state: dict | None, group: str) -> str:
        if state is None or state["last"] is None:
            return f"rank {rank}: no collective yet"
        g, seq, name, t = state["last"]
        return (f"rank {rank}: at #{state['counts'].get(group, 0)} on that group, last issued #{seq} {name} "
                f"on {g} {time.time() - t:.0f}s ago")

    def _on_alarm(self, alarm: dict, state: dict) -> None:
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"rank-{self.rank}.txt")
        last = state["last"]
        mine = (f"rank {self.rank}: last issued collective #{last[1]} {last[2]} on group {last[0]}, "
                f"{time.time() - last[3]:.0f}s ago" if last else f"rank {self.rank}: no collective issued yet")
        with open(path, "a") as f:
            f.write(f"{alarm['report']}\n{mine}\n\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
            f.write("\n")
        self.reports.append(alarm["report"])
        logger.error(f"{alarm['report']}\n    {mine}; stack dumped to {path}")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2 else (
        ", ".join(map(str, ranks)))
