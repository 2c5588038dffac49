"""Deliberate faults for the fault-tolerance tests, read from the TORCHTITAN_FAULTS environment variable.

    TORCHTITAN_FAULTS='[{"kind": "kill_rank", "step": 5, "rank": 1, "attempt": 0}, ...]'

Each fault fires once, in the attempt it names (TORCHTITAN_ATTEMPT, set by tools/restart.py; every attempt
when absent), on the rank it names (every rank when absent):

    kill_rank      SIGKILL in the middle of `step` (after the backward, before the optimizer step)
    kill_in_write  SIGKILL while this rank writes the checkpoint of `step` (its data written, not finished)
    term_in_write  SIGTERM while this rank writes the checkpoint of `step`
    disk_full      the write of the checkpoint of `step` fails with ENOSPC (a full disk)
    sleep          sleep `seconds` in the middle of `step` (a hang or a straggler; every step when `step`
                   is absent)
    poison_grad    multiply this rank's gradients by `scale` (a number, or "nan") in the middle of `step`: a
                   poisoned batch, for the spike guard (components/faults/step_guard.py)
    drop_grad      drop every gradient (None) in the middle of `step`, so the optimizer leaves the weights and
                   its state alone: the guard's `skip` without the guard (its reference run)
    kill_in_removal SIGKILL while retention removes the checkpoint of `step` (renamed to .reclaiming, not yet
                   deleted, the store's removal intent written)
    flip_bit       flip bit `bit` (default 0) of the first word of this rank's first parameter shard in the middle
                   of `step`: silent memory corruption, for the replica check (components/faults/replica_check.py)
    skip_data      leave `step`'s data window out of the stream (the batches are read and dropped): the
                   guard's `rollback` without the guard (its reference run)
    scale_lr       multiply the learning rate by `scale` at `step` and every step after it (a run resumed or
                   rescheduled with a far too high LR: a real spike, for the guard)

Without the variable nothing is installed and `point` returns at once: the trainer may call it every step.
"""

import errno
import json
import os
import signal
import time

_FAULTS: list[dict] = []
KINDS = ("kill_rank", "kill_in_write", "term_in_write", "disk_full", "sleep", "poison_grad", "drop_grad", "skip_data",
         "flip_bit", "kill_in_removal", "scale_lr")
WRITE_KINDS = ("kill_in_write", "term_in_write", "disk_full")


def install(rank: int) -> None:
    """Arms this rank's faults of this attempt; hooks the checkpoint writer only when a write fault is armed."""
    spec = os.environ.get("TORCHTITAN_FAULTS")
    _FAULTS.clear()  # a trainer built again in the same process must not inherit the last run's faults
    if not spec:
        return
    attempt = int(os.environ.get("TORCHTITAN_ATTEMPT", "0"))
    faults = json.loads(spec)
    for f in faults:
        if f["kind"] not in KINDS:
            raise ValueError(f"TORCHTITAN_FAULTS: unknown fault kind {f['kind']!r}; choose from {', '.join(KINDS)}")
    _FAULTS[:] = [
        f for f in faults if f.get("attempt", attempt) == attempt and f.get("rank", rank) == rank
    ]
    if any(f["kind"] in WRITE_KINDS for f in _FAULTS):
        _hook_checkpoint_writer()


def point(step: int, model_parts=(), optimizers=None) -> None:
    """The mid-step fault point (the trainer calls it between the backward and the optimizer step)."""
    if not _FAULTS:
        return
    for f in list(_FAULTS):
        if f["kind"] == "scale_lr" and step >= f["step"] and optimizers is not None:
            for group in optimizers.param_groups:  # the scheduler sets the LR afresh every step
                group["lr"] *= float(f["scale"])
        if f["kind"] == "kill_rank" and f["step"] == step:
            os.kill(os.getpid(), signal.SIGKILL)
        if f["kind"] == "sleep" and f.get("step", step) == step:
            time.sleep(f["seconds"])
        if f["kind"] == "flip_bit" and f["step"] == step:
            _flip_bit(next(p for m in model_parts for p in m.parameters()), f.get("bit", 0))
        if f["kind"] in ("poison_grad", "drop_grad") and f["step"] == step:
            _FAULTS.remove(f)  # once: a step trained again after a rollback gets clean gradients
            for p in (p for m in model_parts for p in m.parameters() if p.grad is not None):
                if f["kind"] == "drop_grad":
                    p.grad = None
                else:
                    p.grad.mul_(float(f["scale"]))


def _flip_bit(param, bit: int) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    with torch.no_grad():
        words = local.view(-1).view(torch.int32)
        words[0] ^= 1 << bit


def removal_point(step: int) -> None:
    """Called by checkpoint retention while it removes the checkpoint of `step`."""
    if any(f["kind"] == "kill_in_removal" and f["step"] == step for f in _FAULTS):
        os.kill(os.getpid(), signal.SIGKILL)


def skips_data(step: int) -> bool:
    """Whether a skip_data fault leaves out `step`'s data window (once)."""
    for f in _FAULTS:
        if f["kind"] == "skip_data" and f["step"] == step:
            _FAULTS.remove(f)
            return True
    return False


def _hook_checkpoint_writer() -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    real = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        # step-N.partial on a local disk, step-N itself on an object store (no rename there)
        path = str(self.path)
        faults = [f for f in _FAULTS if f["kind"] in WRITE_KINDS
                  and (f"step-{f['step']}." in path or path.rstrip("/").endswith(f"step-{f['step']}"))]
        for f in faults:
            if f["kind"] == "disk_full":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        result = real(self, plan, planner)
        for f in faults:
            if f["kind"] == "kill_in_write":
                result.wait()  # this rank's data files are on disk; the checkpoint is not finished
                os.kill(os.getpid(), signal.SIGKILL)
            if f["kind"] == "term_in_write":
                os.kill(os.getpid(), signal.SIGTERM)
        return result

    FileSystemWriter.write_data = write_data
