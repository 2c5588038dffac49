"""Pipeline schedules: the analytic bubble of each schedule's action table, and measured step time on CPU.

Bubble: every schedule's per-rank action list (torch's own `pipeline_order`) is replayed with dependencies
(F of stage s waits for F of stage s-1; the backward of stage s waits for the backward of stage s+1; W
waits for its I) and costs forward 1, full backward 2, input backward 1, weight backward 1, each divided by
the stages per rank so every rank does the same work under every schedule. Communication is free. Bubble =
idle time / (ranks x makespan).

Step time: the real trainer, PP over gloo on this machine, one run per schedule, rounds interleaved; the
median step time of the steps after the first two, per schedule.

    python scripts/benchmarks/bench_pipeline.py                 # tables for pp 2 and 4, timing at pp 2
    python scripts/benchmarks/bench_pipeline.py --no-timing
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torch.distributed.pipelining.schedules import _Action  # noqa: E402
from torch.distributed.pipelining.schedules import _ComputationType as C  # noqa: E402
from torch.distributed.pipelining.schedules import get_schedule_class  # noqa: E402

from torchtitan.distributed.pipeline import SCHEDULES, SINGLE_STAGE  # noqa: E402

COST = {C.FORWARD: 1.0, C.FULL_BACKWARD: 2.0, C.BACKWARD_INPUT: 1.0, C.BACKWARD_WEIGHT: 1.0}


class _TableStage:
    """Just enough of a PipelineStage for a schedule to compute its action table (no process group)."""

    def __init__(self, stage_index: int, num_stages: int, rank: int, pp: int):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_rank, self.group_size = rank, pp
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod = None


def _executed_1f1b(pp: int, n: int) -> dict[int, list[_Action]]:
    """What Schedule1F1B._step_microbatches runs: min(n, pp - rank) warmup forwards, then backward/forward
    pairs, then the remaining backwards. (torch 2.13's Schedule1F1B.pipeline_order, a separate table for
    visualisation, starts the last rank at microbatch 1 and would deadlock.)"""
    order = {}
    for r in range(pp):
        warm = min(n, pp - r)
        acts = [_Action(r, C.FORWARD, m) for m in range(warm)]
        for b in range(n):
            acts.append(_Action(r, C.FULL_BACKWARD, b))
            if warm + b < n:
                acts.append(_Action(r, C.FORWARD, warm + b))
        order[r] = acts
    return order


def action_table(name: str, pp: int, n_microbatches: int) -> tuple[dict[int, list], int]:
    """(rank -> compute actions in execution order, stages per rank) for a schedule on rank 0's view."""
    cls = get_schedule_class(name)
    per_rank = 1 if name in SINGLE_STAGE else 2
    num_stages = pp * per_rank
    if per_rank == 1:
        sched = cls(_TableStage(0, num_stages, 0, pp), n_microbatches=n_microbatches, scale_grads=False)
    else:
        # Which stages rank 0 holds does not change the table, which covers every rank.
        stages = [_TableStage(s, num_stages, 0, pp) for s in range(per_rank)]
        sched = cls(stages, n_microbatches=n_microbatches, scale_grads=False)
    order = _executed_1f1b(pp, n_microbatches) if name == "1F1B" else sched.pipeline_order
    table = {}
    for rank, actions in order.items():
        flat = []
        for a in actions:
            if a is None:
                continue
            flat += list(a.sub_actions) if a.computation_type == C.OVERLAP_F_B else [a]
        table[rank] = [a for a in flat if a.computation_type in COST]
    return table, per_rank


def bubble_fraction(table: dict[int, list], num_stages: int, per_rank: int) -> float:
    """Replays each rank's actions in order, each starting when its rank is free and its inputs exist."""
    done: dict[tuple, float] = {}
    clock = {r: 0.0 for r in table}
    pos = {r: 0 for r in table}
    busy = 0.0

    def ready_at(a):
        s, m, t = a.stage_index, a.microbatch_index, a.computation_type
        if t == C.FORWARD:
            deps = [("F", s - 1, m)] if s > 0 else []
        elif t == C.BACKWARD_WEIGHT:
            deps = [("I", s, m)]
        else:  # full or input backward: own forward, then the next stage's input gradient
            deps = [("F", s, m)] + ([("I", s + 1, m)] if s < num_stages - 1 else [])
        if any(d not in done for d in deps):
            return None
        return max([done[d] for d in deps], default=0.0)

    remaining = sum(len(v) for v in table.values())
    while remaining:
        progressed = False
        for r, actions in table.items():
            while pos[r] < len(actions):
                a = actions[pos[r]]
                t0 = ready_at(a)
                if t0 is None:
                    break
                cost = COST[a.computation_type] / per_rank
                end = max(clock[r], t0) + cost
                clock[r], busy = end, busy + cost
                key = {C.FORWARD: "F", C.BACKWARD_WEIGHT: "W"}.get(a.computation_type, "I")
                done[(key, a.stage_index, a.microbatch_index)] = end
                if a.computation_type == C.FULL_BACKWARD:
                    done[("W", a.stage_index, a.microbatch_index)] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the action table deadlocks")
    makespan = max(clock.values())
    return 1.0 - busy / (len(table) * makespan)


# ---- measured step time ---------------------------------------------------------------------------------
def _train(rank, world_size, argv, folder):
    from torchtitan.protocols.train_spec import config_manager
    from torchtitan.trainer import Trainer

    trainer = Trainer(config_manager().parse_args(argv + ["--job.dump_folder", folder]))
    try:
        trainer.train()
    finally:
        trainer.close()


def step_times(world: int, argv: list[str]) -> list[float]:
    from tests.multiprocess import run_ranks

    folder = tempfile.mkdtemp(prefix="bench_pp_")
    run_ranks(_train, world, argv, folder)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        steps = [json.loads(line) for line in f if '"loss"' in line]
    # Logged every step; tps is per rank, so one step took (tokens per rank) / tps seconds.
    tokens_per_rank = steps[0]["tokens_seen"] / world
    return [tokens_per_rank / m["tps"] for m in steps[2:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--table-pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--flavor", default="debugmodel")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    # The trainer logs to stdout; the tables are printed together at the end.
    out = [f"## Analytic bubble ({args.microbatches} microbatches; F=1, B=2, I=W=1)\n",
           "| schedule | stages/rank | " + " | ".join(f"bubble pp={p}" for p in args.table_pp) + " |",
           "|---|---|" + "---|" * len(args.table_pp)]
    for name in SCHEDULES:
        cells = []
        for pp in args.table_pp:
            table, per_rank = action_table(name, pp, args.microbatches)
            cells.append(f"{bubble_fraction(table, pp * per_rank, per_rank):.3f}")
        out.append(f"| {name} | {1 if name in SINGLE_STAGE else 2} | " + " | ".join(cells) + " |")
    if args.no_timing:
        print("\n".join(out))
        return

    common = [
        "--model.flavor", args.flavor, "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.microbatches), "--training.steps", str(args.steps),
        "--metrics.log_freq", "1", "--parallelism.pipeline_parallel_microbatch_size", "1",
        "--training.mixed_precision_param", "float32",
    ]
    runs = {"no PP (1 rank)": (1, common)}
    for name in SCHEDULES:
        runs[name] = (2, common + ["--parallelism.pipeline_parallel_degree", "2",
                                   "--parallelism.pipeline_parallel_schedule", name])
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(args.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for key in order:
            world, argv = runs[key]
            t = time.perf_counter()
            times[key] += step_times(world, argv)
            print(f"round {r} {key}: {time.perf_counter() - t:.0f}s", file=sys.stderr)
    out += [f"\n## Step time, {args.flavor}, seq {args.seq_len}, batch {args.microbatches} x 1-sequence microbatches, "
            f"fp32, CPU/gloo ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n",
            "| layout | median step (s) | vs. no PP |",
            "|---|---|---|"]
    base = statistics.median(times["no PP (1 rank)"])
    for key, ts in times.items():
        med = statistics.median(ts)
        out.append(f"| {key} | {med:.3f} | {med / base:.2f}x |")
    print("\n".join(out))


if __name__ == "__main__":
    main()
