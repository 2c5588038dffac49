"""Run a function on N real ranks (gloo over loopback) and collect what each returns.

Multi-rank features are proved with real process groups, not mocks: every rank is a fresh process
that joins a gloo group on 127.0.0.1 at a free port, runs `fn(rank, world_size, *args)`, and sends its
return value (picklable) back. A failure on any rank fails the call with that rank's traceback.

The ranks are forked from multiprocessing's fork server, which imports torch and the trainer once for the
whole session: a rank then starts in ~0.1 s instead of the 3-10 s each spawned rank spent importing them
(on a 2-core CI machine, minutes over the suite). The server is a clean process that never runs a test, so
every rank still starts from an untouched interpreter, as a spawned one did; the caller's environment and
working directory at the call are handed to the ranks (a fork server's children would otherwise inherit
the server's, from when it started).
"""

import io
import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported by the fork server before it forks any rank (what every rank needs anyway).
_PRELOAD = ["torch", "torch.distributed", "torchtitan.trainer", "tests.multiprocess"]
_context = None


def _rank_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _worker(rank, world_size, port, fn, args, queue, env, cwd):
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    if os.environ.get("TT_TOLERANCE_LOG"):
        from tests.conftest import record_in_rank

        record_in_rank()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # As bytes: tensors sent through the queue would live in shared memory owned by this process,
        # which exits before the parent reads them.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # report every failure, including assertion errors, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results ordered by rank."""
    ctx = _rank_context()
    queue = ctx.Queue()
    port = free_port()
    env, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, env, cwd), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks are likely stuck in a collective; stop waiting for them
    finally:
        for p in procs:
            p.join(timeout=5 if errors else timeout)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
