"""The planner against published layouts: where each published layout ranks, the planner's own pick,
why they differ, and predicted vs published throughput (tokens/s/GPU).

    PYTHONPATH=$PWD python3 scripts/planning/published_layouts.py

The cases and their sources are torchtitan/planning/published.py PUBLISHED (and docs/planning.md).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.planning.published import MEMORY, PUBLISHED, RATIOS, TIE, compare  # noqa: E402


HEADROOMS = (0.0, 0.1, 0.2, 0.3)


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
    print("\nThe estimator against published GPU memory (max reserved per GPU; not fitted):\n")
    print("| run | measured GiB | estimated GiB | estimate / measured | source |")
    print("|---|---|---|---|---|")
    for m in MEMORY:
        est = m.estimate_gib()
        print(f"| {m.name} | {m.measured_gib:.1f} | {est:.1f} | {est / m.measured_gib:.2f} | {m.source} |")
    print("\nThe verdicts against the room left free (--memory-headroom): rank of the published degrees among all "
          "layouts / among the layouts of the same parallelisms, gap to the first of each\n")
    print("| case | " + " | ".join(f"headroom {100 * h:.0f}%" for h in HEADROOMS) + " |")
    print("|---|" + "---|" * len(HEADROOMS))
    for case in PUBLISHED:
        cells = []
        for h in HEADROOMS:
            c = compare(case, h)
            if c.rank is None:
                cells.append("does not fit")
                continue
            r, g, _ = c.within
            cells.append(f"{c.rank} (+{100 * c.gap:.1f}%) / {r} (+{100 * g:.1f}%)")
        print(f"| {case.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
