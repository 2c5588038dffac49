"""Graceful preemption: SIGTERM (what schedulers and torchrun send before killing a job) stops training at
the next step boundary, after a checkpoint of that step.

The handler only sets a flag: a checkpoint cannot be written from inside a signal handler (it may interrupt a
collective or a half-done optimizer step, and logging there can deadlock on the logging lock).
"""

import signal
import threading

import torch
import torch.distributed as dist


class PreemptionWatch:
    def __init__(self) -> None:
        self._flag = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():  # Python only delivers signals there
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self._flag = True

    def requested(self, device: torch.device) -> bool:
        """Whether any rank got SIGTERM. Ranks receive it at slightly different moments, so they agree (MAX
        over all ranks) on the same step boundary to save and stop at; one tiny all-reduce per step."""
        if not dist.is_initialized():
            return self._flag
        flag = torch.tensor([1.0 if self._flag else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
