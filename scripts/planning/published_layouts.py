"""The planner against published layouts: where each published layout ranks, the planner's own pick, and
predicted vs published throughput (tokens/s/GPU).

    PYTHONPATH=$PWD python3 scripts/planning/published_layouts.py

Sources of the published figures are in docs/planning.md (and in PUBLISHED below).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torchtitan.models.llama3 import llama3_flavors  # noqa: E402
from torchtitan.planning.hardware import get_device  # noqa: E402
from torchtitan.planning.memory import ModelShape  # noqa: E402
from torchtitan.planning.planner import PUBLISHED, matches, plan_layouts  # noqa: E402


def main() -> None:
    device = get_device("H100-80GB")
    print("| case | published layout | its rank (of fitting) | its predicted step vs #1 | planner's #1 | "
          "predicted / published tokens/s/GPU |")
    print("|---|---|---|---|---|---|")
    for case in PUBLISHED:
        shape = ModelShape.from_args(llama3_flavors[case.flavor])
        result = plan_layouts(shape, device, case.devices, case.seq_len, case.global_batch_size,
                              network=case.network)
        rank = next((i for i, c in enumerate(result.ranked, 1) if matches(c.layout, case)), None)
        cand = result.ranked[rank - 1] if rank else None
        ratio = (f"{cand.tokens_per_s_per_device:,.0f} / {case.tokens_per_s:,.0f} = "
                 f"{cand.tokens_per_s_per_device / case.tokens_per_s:.2f}") if cand and case.tokens_per_s else "-"
        gap = f"+{100 * (cand.time.total / result.ranked[0].time.total - 1):.1f}%" if cand else "-"
        print(f"| {case.name} | {case.describe()} | {rank} of {len(result.ranked)} | {gap} | "
              f"{result.ranked[0].layout.describe()} | {ratio} |")


if __name__ == "__main__":
    main()
