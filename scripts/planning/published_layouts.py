"""The planner against published layouts: where each published layout ranks, the planner's own pick,
why they differ, and predicted vs published throughput (tokens/s/GPU).

    PYTHONPATH=$PWD python3 scripts/planning/published_layouts.py

The cases and their sources are torchtitan/planning/published.py PUBLISHED (and docs/planning.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.planning.published import PUBLISHED, RATIOS, TIE, compare  # noqa: E402


def main() -> None:
    rows, notes = [], []
    for case in PUBLISHED:
        c = compare(case)
        first = c.result.ranked[0]
        ours = c.result.ranked[c.rank - 1] if c.rank else None
        ratio = (f"{ours.tokens_per_s_per_device:,.0f} / {case.tokens_per_s:,.0f} = "
                 f"{ours.tokens_per_s_per_device / case.tokens_per_s:.2f}") if ours else "-"
        gap = f"+{100 * c.gap:.1f}%" if ours else "-"
        within = "-"
        if c.within:
            r, g, top = c.within
            within = f"{r} (+{100 * g:.1f}%)" + ("" if r == 1 else f"; first: {top.layout.describe()}")
        rows.append(f"| {case.name} ({case.device}, global batch {case.global_batch_size}) | {case.describe()} | "
                    f"{c.rank} of {len(c.result.ranked)} | {gap} | {first.layout.describe()} | {within} | {ratio} |")
        notes.append(f"- {case.name}: {c.reason}.")
        if ours:
            notes.append(f"  published degrees, best variant: {ours.layout.describe()}; "
                         f"peak {ours.memory.peak / 2**30:.1f} GiB")
    print("| case | published layout | its rank (of fitting) | its predicted step vs #1 | planner's #1 | "
          "its rank among layouts of the same parallelisms | predicted / published tokens/s/GPU |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("\n".join(notes))
    print(f"\n(A gap under {100 * TIE:.0f}% is a tie: below what the model resolves.)\n")
    print("Relative predictions against pairs of published runs (the ranking rests on these):\n")
    print("| pair | published | predicted | role | source |")
    print("|---|---|---|---|---|")
    for pair in RATIOS:
        print(f"| {pair.name} | x{pair.published:.3f} | x{pair.predicted():.3f} | {pair.role} | {pair.source} |")


if __name__ == "__main__":
    main()
