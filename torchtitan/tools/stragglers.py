"""Stragglers: which rank makes the others wait, and by how much.

In a synchronous step every rank waits at the step's last collective (the gradient-norm reduction) for the
slowest one, so the wall time of a step is the same everywhere and hides the culprit. Each rank therefore
times its own part: from the start of the step (data loading included) until its gradients are ready, and its
data loading alone. Every log step one small all-gather brings these means to every rank; the slowest rank,
its lag behind the median rank and both times go to the metrics (`straggler/*` in metrics.jsonl), and a
warning names the rank when its lag exceeds --metrics.straggler_threshold of the median.

Waits inside collectives before the last one (FSDP's all-gathers) count in every rank's time alike, so the lag
is what the slowest rank adds after the step's last synchronization: for a rank that is slow throughout, its
whole excess over that stretch.
"""

import time

import torch
import torch.distributed as dist

from torchtitan.tools.logging import logger


class StepClock:
    """This rank's data time and time-to-ready, summed over the steps since the last report."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.steps, self.data_s, self.ready_s, self._start = 0, 0.0, 0.0, 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def data_loaded(self) -> None:
        self.data_s += time.perf_counter() - self._start

    def ready(self) -> None:
        """Gradients computed: what follows is waiting for the slowest rank."""
        self.ready_s += time.perf_counter() - self._start
        self.steps += 1


def report(clock: StepClock, threshold: float, device: torch.device) -> dict[str, float]:
    """Gathers every rank's per-step means (one all-gather), warns about a straggler, resets the clock."""
    if not dist.is_initialized() or clock.steps == 0:
        clock.reset()
        return {}
    mine = torch.tensor([clock.ready_s / clock.steps, clock.data_s / clock.steps], dtype=torch.float64, device=device)
    clock.reset()
    table = torch.empty(dist.get_world_size() * 2, dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(table, mine)
    table = table.view(-1, 2)
    ready, data = table[:, 0].cpu(), table[:, 1].cpu()
    slowest = int(ready.argmax())
    median = float(ready.median())
    lag = float(ready[slowest]) - median
    if median > 0 and lag > threshold * median:
        logger.warning(
            f"straggler: rank {slowest} needs {float(ready[slowest]):.3f}s per step to get its gradients ready, "
            f"{lag:.3f}s ({100 * lag / median:.0f}%) more than the median rank (its data loading: "
            f"{float(data[slowest]):.3f}s per step, the median rank's {float(data.median()):.3f}s)"
        )
    return {
        "straggler/slowest_rank": slowest,
        "straggler/lag_s": lag,
        "straggler/ready_s_max": float(ready[slowest]),
        "straggler/ready_s_median": median,
        "straggler/data_s_max": float(data.max()),
    }
