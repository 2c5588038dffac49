"""How close each of the suite's numerical comparisons comes to its tolerance, per kernel set.

    TT_TOLERANCE_LOG=/tmp/default.jsonl ./scripts/run_tests.sh
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        TT_TOLERANCE_LOG=/tmp/avx2.jsonl ./scripts/run_tests.sh
    python scripts/diagnostics/tolerance_margins.py /tmp/default.jsonl /tmp/avx2.jsonl --top 30

Each log line is one `torch.testing.assert_close` (tests/conftest.py writes them); `usage` is the largest
|actual - expected| / (atol + rtol |expected|) of the comparison: above 1 it failed. A test is listed once per
log with its largest usage, the logs side by side, sorted by the largest of them: a test near 1 under any
kernel set is a tolerance to re-derive, not to widen by hand. Comparisons far above 1 in a passing test are
negative controls (a `pytest.raises` around a comparison that must fail); they are left out (--all keeps them).
"""

import argparse
import json
from pathlib import Path


def worst_by_test(path: str, keep_failed: bool) -> dict[str, dict]:
    worst: dict[str, dict] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row["usage"] > 1 and not keep_failed:
            continue
        if row["test"] not in worst or row["usage"] > worst[row["test"]]["usage"]:
            worst[row["test"]] = row
    return worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("logs", nargs="+", help="TT_TOLERANCE_LOG files, one per kernel set")
    p.add_argument("--top", type=int, default=25, help="rows to print")
    p.add_argument("--all", action="store_true", help="keep comparisons that failed (negative controls)")
    args = p.parse_args(argv)
    logs = [worst_by_test(path, args.all) for path in args.logs]
    tests = sorted({t for log in logs for t in log},
                   key=lambda t: -max(log[t]["usage"] for log in logs if t in log))
    names = [Path(path).stem for path in args.logs]
    print("  ".join(f"{n[:14]:>14}" for n in names) + "  rtol      atol      test")
    for t in tests[: args.top]:
        cells = [f"{log[t]['usage']:14.3g}" if t in log else f"{'-':>14}" for log in logs]
        row = next(log[t] for log in logs if t in log)
        print("  ".join(cells) + f"  {row['rtol']:<8.2g}  {row['atol']:<8.2g}  {t}")
    print(f"{len(tests)} tests compared numbers; usage = largest |diff| / (atol + rtol |expected|), fails above 1")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
