"""Plot the metrics of one or several runs against step, into one PNG.

    python scripts/runs/plot_metrics.py RUN [RUN ...] [-o metrics.png] [--label NAME ...]

RUN is a run folder (`job.dump_folder`, holding metrics.jsonl) or a metrics.jsonl file. Panels: loss (with the
validation loss dashed where logged), grad norm, learning rate, tokens/s per device and MFU, and, when a run
logged evaluations ([eval]), one more panel with every eval/<task>/<metric> score (error bars: its _stderr);
runs share colours across panels. Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_metrics import RunError, read_metrics, series  # noqa: E402

PANELS = [  # (metrics key, title, log scale)
    ("loss", "loss", False),
    ("grad_norm", "grad norm", True),
    ("lr", "learning rate", False),
    ("tps", "tokens/s per device", False),
    ("mfu", "MFU %", False),
]


def plot(runs: list[str], labels: list[str], output: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RunError('plotting needs matplotlib: pip install -e ".[plot]"') from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    data = [read_metrics(run) for run in runs]
    scores = eval_scores(data)
    panels = PANELS + ([("eval", "evaluation", False)] if scores else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), constrained_layout=True)
    for (key, title, log), ax in zip(panels, axes):
        if key == "eval":
            _plot_scores(ax, data, labels, scores)
            continue
        for i, (metrics, label) in enumerate(zip(data, labels)):
            color = f"C{i}"
            steps, values = series(metrics, key)
            ax.plot(steps, values, color=color, label=label, marker="." if len(steps) < 30 else None)
            if key == "loss":
                v_steps, v_values = series(metrics, "validation/loss")
                if v_steps:
                    ax.plot(v_steps, v_values, color=color, linestyle="--", marker="o", label=f"{label} (validation)")
        ax.set_title(title)
        ax.set_xlabel("step")
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small", loc="best")
    fig.savefig(output, dpi=80)
    plt.close(fig)


def eval_scores(data: list[dict[int, dict[str, float]]]) -> list[str]:
    """The eval/<task>/<metric> keys any run logged (not their _stderr, request and row counts or timings)."""
    keys = {k for metrics in data for m in metrics.values() for k in m if k.startswith("eval/")}
    return sorted(k for k in keys if not k.endswith(("_stderr", "/requests", "/rows", "/seconds")))


def _plot_scores(ax, data, labels, scores: list[str]) -> None:
    styles = ["-", "--", ":", "-."]
    for i, (metrics, label) in enumerate(zip(data, labels)):
        for j, key in enumerate(scores):
            steps, values = series(metrics, key)
            if not steps:
                continue
            _, errors = series(metrics, f"{key}_stderr")
            ax.errorbar(steps, values, yerr=errors if len(errors) == len(steps) else None, color=f"C{i}",
                        linestyle=styles[j % len(styles)], marker="o", capsize=2,
                        label=f"{label}: {key[len('eval/'):]}")
    ax.legend(fontsize="x-small", loc="best")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN")
    p.add_argument("-o", "--output", default="metrics.png", help="PNG to write (default: metrics.png)")
    p.add_argument("--label", action="append", help="legend name of each RUN, in order (default: the paths)")
    args = p.parse_args(argv)
    labels = args.label or args.runs
    if len(labels) != len(args.runs):
        p.error(f"{len(args.runs)} runs but {len(labels)} --label values")
    try:
        plot(args.runs, labels, args.output)
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
