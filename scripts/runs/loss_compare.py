"""Compare the training losses of two runs step by step: where they first differ, and whether they stay within
a relative tolerance. What to run after changing a layout (same seed and data, another parallelism): the
losses should agree to float32 summation-order noise.

    python scripts/runs/loss_compare.py RUN_A RUN_B [--rtol 1e-5] [--atol 0]

RUN is a run folder or a metrics.jsonl file; steps logged by both runs are compared. Prints the first step whose
losses differ at all, the largest difference, and the first step beyond the tolerance if any. Exit code: 0 within
tolerance, 1 beyond it (or a loss NaN in one run only), 2 when a run cannot be read or the runs share no step.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_metrics import RunError, read_metrics, series  # noqa: E402


def _relative(a: float, b: float) -> float:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-30) if math.isfinite(a - b) else math.inf


def compare(run_a: str, run_b: str, rtol: float, atol: float) -> tuple[bool, list[str]]:
    """(within tolerance, report lines)."""
    steps_a, loss_a = series(read_metrics(run_a), "loss")
    steps_b, loss_b = series(read_metrics(run_b), "loss")
    a, b = dict(zip(steps_a, loss_a)), dict(zip(steps_b, loss_b))
    common = sorted(set(a) & set(b))
    if not common:
        raise RunError(f"{run_a} and {run_b} logged the loss at no common step")
    lines = [f"compared {len(common)} steps ({common[0]}..{common[-1]}) logged by both runs"]
    if set(a) != set(b):
        lines.append(f"steps logged by one run only are skipped: {len(set(a) ^ set(b))}")

    def beyond(step: int) -> bool:
        x, y = a[step], b[step]
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) != math.isnan(y)
        return not abs(x - y) <= atol + rtol * abs(y)

    def describe(step: int) -> str:
        return f"step {step}: {a[step]:.8g} vs {b[step]:.8g} (relative {_relative(a[step], b[step]):.2e})"

    differing = [s for s in common if _relative(a[s], b[s]) > 0]
    if not differing:
        lines.append("the losses are identical at every compared step")
        return True, lines
    lines.append(f"first difference at {describe(differing[0])}")
    worst = max(differing, key=lambda s: _relative(a[s], b[s]))
    lines.append(f"largest difference at {describe(worst)}")
    bad = [s for s in common if beyond(s)]
    if bad:
        lines.append(f"BEYOND tolerance (rtol {rtol:g}, atol {atol:g}) first at {describe(bad[0])}; {len(bad)} steps in all")
        return False, lines
    lines.append(f"within tolerance (rtol {rtol:g}, atol {atol:g}) at every compared step")
    return True, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance per step (default: 1e-5)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance per step (default: 0)")
    args = p.parse_args(argv)
    try:
        ok, lines = compare(args.run_a, args.run_b, args.rtol, args.atol)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
