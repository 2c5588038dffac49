"""Plot the metrics of one or several runs against step, into one PNG.

    python scripts/runs/plot_metrics.py RUN [RUN ...] [-o metrics.png] [--label NAME ...]

RUN is a run folder (`job.dump_folder`, holding metrics.jsonl) or a metrics.jsonl file. Panels: loss (with the
validation loss dashed where logged), grad norm, learning rate, tokens/s per device and MFU; runs share colours
across panels. Needs matplotlib (`pip install -e ".[plot]"`).
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
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2), constrained_layout=True)
    for (key, title, log), ax in zip(PANELS, axes):
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
