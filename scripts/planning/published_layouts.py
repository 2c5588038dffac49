"""The planner against published runs.

    PYTHONPATH=$PWD python3 scripts/planning/published_layouts.py [--held-out]

Default: every run of the corpus (torchtitan/planning/published.py CORPUS) with its split (training: the runs
the fitted constants saw; held out: the others), predicted vs published tokens/s/GPU and peak memory; the
published pairs that differ in one choice; and where the planner, free to choose, ranks the published layouts.
--held-out: the held-out runs only, their error summary and the pairs (docs/planning.md quotes this table).
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.planning.published import (  # noqa: E402
    CORPUS,
    HELD_OUT,
    PUBLISHED,
    TIE,
    TRAINING,
    compare,
    fit_constants,
    single_choice_pairs,
)


def corpus_table(runs) -> list[str]:
    rows = ["| # | split | run | layout as run | published | predicted | predicted / published | memory GiB "
            "published / estimated | source |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        c = r.predict()
        p = c.tokens_per_s_per_device
        est = c.memory.allocator_reserved / 2**30  # what torchtitan's tables quote: the allocator's max reserved
        mem = f"{r.memory_gib:.1f} / {est:.1f} ({est / r.memory_gib:.2f})" if r.memory_gib else "-"
        split = "held out" if r in HELD_OUT else "training"
        rows.append(f"| {CORPUS.index(r)} | {split} | {r.name} | {r.layout.describe()} | {r.tokens_per_s:,.0f} | "
                    f"{p:,.0f} | {p / r.tokens_per_s:.2f} | {mem} | {r.source.split(':')[0]}; "
                    f"{r.source.split(', ')[-1]} |")
    return rows


def summary(name: str, runs) -> str:
    ratios = [r.predict().tokens_per_s_per_device / r.tokens_per_s for r in runs]
    errs = [abs(x - 1) for x in ratios]
    mems = [abs(r.predict().memory.allocator_reserved / 2**30 / r.memory_gib - 1) for r in runs if r.memory_gib]
    return (f"{name}: {len(runs)} runs, tokens/s error median {100 * statistics.median(errs):.1f}%, max "
            f"{100 * max(errs):.1f}%, {sum(e <= 0.15 for e in errs)} of {len(runs)} within 15%; predicted / published "
            f"{min(ratios):.2f}-{max(ratios):.2f}; memory ({len(mems)} reported) within 10%: "
            f"{sum(e <= 0.10 for e in mems)} of {len(mems)}")


def pairs_table() -> list[str]:
    rows = ["| choice | a -> b | published b / a | predicted b / a | verdict |", "|---|---|---|---|---|"]
    for a, b, what in single_choice_pairs():
        pub = b.tokens_per_s / a.tokens_per_s
        pred = b.predict().tokens_per_s_per_device / a.predict().tokens_per_s_per_device
        same = (pub - 1) * (pred - 1) > 0
        verdict = (f"tie (within {100 * TIE:.0f}%)" if abs(pred - 1) < TIE else "same order" if same
                   else "WRONG ORDER")
        rows.append(f"| {what} | {a.name} -> {b.name} | x{pub:.3f} | x{pred:.3f} | {verdict} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held-out", action="store_true", help="the held-out runs only, with the error summary")
    a = ap.parse_args()
    print(f"Fitted on the training half only: {fit_constants()}\n")
    print("\n".join(corpus_table(HELD_OUT if a.held_out else CORPUS)))
    print()
    if not a.held_out:
        print(summary("training", TRAINING))
    print(summary("held out", HELD_OUT))
    print("\nPublished pairs that differ in one choice:\n")
    print("\n".join(pairs_table()))
    if a.held_out:
        return
    print("\nThe planner, free to choose the degrees, AC and batch split, against the published layouts:\n")
    print("| case | published layout | its rank (of fitting) | its predicted step vs #1 | planner's #1 | why |")
    print("|---|---|---|---|---|---|")
    for case in PUBLISHED:
        c = compare(case)
        first = c.result.ranked[0]
        gap = f"+{100 * c.gap:.1f}%" if c.rank else "-"
        print(f"| {case.name} | {case.describe()} | {c.rank} of {len(c.result.ranked)} | {gap} | "
              f"{first.layout.describe()} | {c.reason} |")


if __name__ == "__main__":
    main()
