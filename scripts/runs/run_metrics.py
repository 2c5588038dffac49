"""Reading a run's metrics.jsonl: shared by plot_metrics.py and loss_compare.py.

A RUN argument is a run folder (its `metrics.jsonl` is read) or a metrics.jsonl file itself. A resumed run
appends, so a step may appear twice: the last occurrence wins, as in the trainer's own docs.
"""

import json
import math
from pathlib import Path


class RunError(ValueError):
    """A run folder or metrics file that cannot be read; the message is one line."""


def metrics_file(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise RunError(f"{run}: no metrics.jsonl (expected a run folder or a metrics.jsonl file)")
    return path


def read_metrics(run: str) -> dict[int, dict[str, float]]:
    """step -> the metrics logged at that step (training and validation lines merged)."""
    path = metrics_file(run)
    steps: dict[int, dict[str, float]] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                step = int(record.pop("step"))
            except (ValueError, KeyError, TypeError) as e:
                raise RunError(f"{path}:{lineno}: not a metrics line ({e})") from None
            steps.setdefault(step, {}).update(record)
    if not steps:
        raise RunError(f"{path} holds no metrics")
    return dict(sorted(steps.items()))


def series(metrics: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` where it was logged, non-finite values kept (a NaN loss must show)."""
    points = [(step, float(m[key])) for step, m in metrics.items() if key in m]
    return [s for s, _ in points], [v if not math.isinf(v) else math.nan for _, v in points]
