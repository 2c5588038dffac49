"""How far the cost and memory models were from published runs they were not fitted on, as ranges a prediction
is printed with: the planner (`python -m torchtitan.plan`) and the dry run (`--device-type`) both say where a
published figure lay for such a prediction. The ranges come from planning/published.py's HELD_OUT runs and
are checked against them by tests/unit/test_planner.py (a test fails when one is wider or narrower than the
corpus gives); this module holds only the numbers and the arithmetic, so family-agnostic code can use them
without importing the corpus (which names a model family)."""

from torchtitan.planning.memory import MemoryEstimate

HELD_OUT_RATIO_RANGE = (0.86, 1.14)
"""Predicted / published tokens/s over HELD_OUT, rounded outward to 0.01: a prediction P stands for a published
figure in [P / 1.14, P / 0.86]."""
HELD_OUT_MEDIAN_ERROR = 0.05
"""Median |predicted / published - 1| over HELD_OUT, rounded up."""

HELD_OUT_MEMORY_RANGE = {False: (0.95, 1.07), True: (0.75, 0.96)}
"""Estimated / published peak memory (the allocator's reserved bytes, what torchtitan logs) over the HELD_OUT
runs that publish it, without and with PP, rounded outward to 0.01: 7 runs without PP; 3 with, all 405B at
PP 8 x TP 8, the family whose first stage the estimator reads low (docs/planning.md, "Cases it still misses"),
so a PP estimate stands for up to a third more."""


def interval(tokens_per_s: float) -> tuple[float, float]:
    """Where the published figure of a prediction lay for the held-out runs (HELD_OUT_RATIO_RANGE)."""
    lo, hi = HELD_OUT_RATIO_RANGE
    return tokens_per_s / hi, tokens_per_s / lo


def memory_interval(memory: MemoryEstimate, pipelined: bool) -> tuple[float, float]:
    """Where the published peak of a layout with this estimate lay for the held-out runs
    (HELD_OUT_MEMORY_RANGE), in bytes with the CUDA runtime's share (outside the allocator) added back."""
    lo, hi = HELD_OUT_MEMORY_RANGE[pipelined]
    runtime = memory.peak - memory.allocator_reserved
    return memory.allocator_reserved / hi + runtime, memory.allocator_reserved / lo + runtime


def memory_interval_line(memory: MemoryEstimate, pipelined: bool, device_memory_bytes: float) -> str:
    """One line: the memory interval of a GPU estimate, flagged when its upper end passes the device's memory."""
    low, high = memory_interval(memory, pipelined)
    return (f"memory interval {low / 2**30:.1f}-{high / 2**30:.1f} GiB"
            + (f": above the device's {device_memory_bytes / 2**30:.1f} GiB at the upper end"
               if high > device_memory_bytes else ""))
