"""Faults at random moments, survived by automatic restart with bitwise-equal continuation.

Each test runs the real launch path: `python -m torchtitan.tools.restart -- torchrun -m torchtitan.train` on 2
gloo ranks (FSDP 2, async checkpoints every 2 steps), with two faults of one kind injected at seeded random
steps (tools/fault_injection.py), one per attempt (four SIGKILLs of a rank, checkpoints every step, for
kill_rank: one more than the supervisor's default same-failure limit of 3). The supervisor restarts the job
after each fault: each attempt completes a newer checkpoint before its fault, so failing the same way again and
again is progress, not a streak (tools/restart.py); every
attempt must resume from the newest complete checkpoint (never a `.partial` one), and every step any attempt
logs must have exactly the loss and grad norm of an uninterrupted run: a skipped or repeated sample, or lost
optimizer or RNG state, changes the losses that follow. Complete checkpoints are never deleted by a fault.

Reproduce one by hand: see docs/reliability.md.
"""

import json
import os
import random
import re
import subprocess
import sys

import pytest
import torch

from tests.distributed.test_parity_2d import assert_parity
from tests.distributed.trainer_runs import curves, read_metrics, train
from tests.multiprocess import free_port
from torchtitan.components.checkpoint import folders

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

STEPS = 12
ARGS = [
    "--model.flavor", "debugmodel_tiny",
    "--training.seq_len", "32",
    "--training.global_batch_size", "4",
    "--training.local_batch_size", "2",
    "--parallelism.data_parallel_shard_degree", "2",
    "--training.steps", str(STEPS),
    "--training.mixed_precision_param", "float32",
    "--optimizer.lr", "3e-2",
    "--lr_scheduler.warmup_steps", "2",
    "--metrics.log_freq", "1",
    "--debug.seed", "7",
    "--debug.deterministic",
    "--checkpoint.enable",
    "--checkpoint.interval", "2",
    "--checkpoint.async_mode", "async",
    "--checkpoint.keep_latest_k", "0",
]


def torchrun(nproc: int, argv: list[str], folder: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--max-restarts=0",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--monitor-interval=0.1",
            "-m", "torchtitan.train", *ARGS, "--parallelism.data_parallel_shard_degree", str(nproc), *argv,
            "--job.dump_folder", folder]


def supervised(cmd: list[str], faults: list[dict], max_restarts: int = 3, same_failure_limit: int = 3):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHTITAN_FAULTS": json.dumps(faults)}
    sup = [sys.executable, "-m", "torchtitan.tools.restart", f"--max-restarts={max_restarts}",
           f"--same-failure-limit={same_failure_limit}", "--"]
    # One pipe for both streams, so the supervisor's lines fall between the attempts' output.
    return subprocess.run(sup + cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: same recipe, same world size, no faults."""
    steps, _ = train(2, ARGS, str(tmp_path_factory.mktemp("ref")))
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in steps}


def split_attempts(log: str, n_faults: int) -> list[str]:
    """The supervisor's "restart:" lines split its output into the attempts' outputs."""
    outputs = re.split(r"^restart: attempt \d+ failed.*$", log, flags=re.M)
    assert len(outputs) == n_faults + 1, f"expected {n_faults} restarts:\n{log[-3000:]}"
    return outputs


def check_continuation(folder: str, outputs: list[str]) -> list[list[dict]]:
    """Each restarted attempt resumes from a complete checkpoint (step-N, never step-N.partial) and continues at
    the step after it (or starts over when the fault came before the first checkpoint was complete), and no
    attempt skips a step; returns each attempt's logged steps (rank 0's metrics.jsonl, split by attempt)."""
    logged = iter(m for m in read_metrics(folder) if "loss" in m)  # every attempt appends to metrics.jsonl
    runs = []
    for i, output in enumerate(outputs):
        printed = [int(s) for s in re.findall(r"^(?:\[rank 0\] )?\[titan\].*step:\s+(\d+)\s", output, flags=re.M)]
        run = [next(logged) for _ in printed]
        assert [m["step"] for m in run] == printed
        runs.append(run)
        if i == 0:
            continue
        loaded = re.findall(r"^(?:\[rank 0\] )?\[titan\].*Resumed from (\S+)", output, flags=re.M)
        assert len(loaded) <= 1 and all(re.search(r"/step-\d+$", p) for p in loaded), f"loaded {loaded}"
        resumed = int(loaded[0].rsplit("-", 1)[1]) if loaded else 0
        assert printed[:1] in ([], [resumed + 1]), f"resumed from step {resumed} but continued at step {printed[0]}"
        assert printed[0] == resumed + 1 if printed else True, f"resumed from step {resumed} but continued at step {printed[0]}"
    for run in filter(None, runs):
        steps = [m["step"] for m in run]
        assert steps == list(range(steps[0], steps[0] + len(steps))), f"an attempt skipped a step: {steps}"
    assert runs[-1][-1]["step"] == STEPS
    return runs


def assert_bitwise(runs: list[list[dict]], reference: dict) -> None:
    for m in (m for run in runs for m in run):
        assert (m["loss"], m["grad_norm"]) == reference[m["step"]], (
            f"step {m['step']} differs from the uninterrupted run: {m['loss']!r} vs {reference[m['step']][0]!r}"
        )


KILLS = 4  # kill_rank: more faults than the same-failure limit (3), each after a newer checkpoint
WRITE_FAULTS = 2  # the write faults: a repeated fault, each attempt resuming from the newest complete checkpoint
EXTRA_ARGS = {"kill_rank": ["--checkpoint.interval", "1"]}


def fault_plan(kind: str, seed: int) -> list[dict]:
    """WRITE_FAULTS faults of `kind` (KILLS for kill_rank) at seeded random steps, one per attempt, each later than
    the one before, so every attempt gets past the previous fault and completes a newer checkpoint before its
    own: with async saves every step, the attempt that resumes from step r (two behind the step it was killed
    in, whose save was in flight) completes step r+1 when it saves r+2, so a kill at a later step than the
    last one, from step 3 on, comes after progress. Write faults hit checkpoint steps."""
    rng = random.Random(seed)
    if kind == "kill_rank":
        steps = sorted(rng.sample(range(3, STEPS), KILLS))
        return [{"kind": kind, "step": s, "attempt": i, "rank": rng.randrange(2)} for i, s in enumerate(steps)]
    candidates = {
        "kill_rank": range(2, STEPS),
        # A SIGTERM stops the run at the next step boundary, unless that is the last step (nothing to resume).
        "term_in_write": range(2, STEPS - 2, 2),
    }.get(kind, range(2, STEPS, 2))
    steps = sorted(rng.sample(candidates, WRITE_FAULTS))
    return [{"kind": kind, "step": s, "attempt": i, **({"rank": rng.randrange(2)} if kind != "kill_in_write" else {})}
            for i, s in enumerate(steps)]


@pytest.mark.parametrize("kind", ["kill_rank", "kill_in_write", "term_in_write", "disk_full"])
def test_fault_then_exact_continuation(kind, reference, tmp_path):
    seed = int(os.environ.get("TORCHTITAN_FAULT_SEED", "0")) * 100 + ["kill_rank", "kill_in_write", "term_in_write",
                                                                      "disk_full"].index(kind)
    faults = fault_plan(kind, seed)
    folder = str(tmp_path)
    # Faults of one kind often fail the same way every time (a SIGKILLed rank dies silently): only the progress
    # each attempt made keeps the default same-failure limit from stopping the run.
    result = supervised(torchrun(2, EXTRA_ARGS.get(kind, []), folder), faults, max_restarts=len(faults))
    log = result.stdout
    assert result.returncode == 0, f"faults {faults} (seed {seed}):\n{log[-5000:]}"
    assert_bitwise(check_continuation(folder, split_attempts(log, len(faults))), reference)
    root = os.path.join(folder, "checkpoint")
    # keep_latest_k 0 keeps every checkpoint: each interval save must be there and complete (preemption adds
    # saves at odd steps).
    for step in range(2, STEPS, 2):
        assert folders.problem(os.path.join(root, f"step-{step}")) is None, sorted(os.listdir(root))


def test_same_failure_without_progress_stops_with_one_line(reference, tmp_path):
    """A full disk that stays full: the save of step 4 fails on every attempt. The first attempt completed
    step-2 before failing (progress); the next two resume from step-2 and fail at step 4 again with nothing
    newer: after those two (the limit) the supervisor stops with one line instead of spending its budget, and
    step-2 is intact."""
    folder = str(tmp_path)
    faults = [{"kind": "disk_full", "step": 4}]  # every attempt, every rank
    result = supervised(torchrun(2, [], folder), faults, max_restarts=5, same_failure_limit=2)
    log = result.stdout
    assert result.returncode != 0
    stops = [line for line in log.splitlines() if line.startswith("error: the run failed the same way")]
    assert len(stops) == 1 and "No space left on device" in stops[0] and "2 times" in stops[0], log[-3000:]
    assert len(re.findall(r"^restart: attempt", log, flags=re.M)) == 2  # three failures at step 4
    root = os.path.join(folder, "checkpoint")
    assert folders.problem(os.path.join(root, "step-2")) is None
    assert "step-4" not in os.listdir(root)


def test_node_lost_then_back_resumes_under_another_world(reference, tmp_path):
    """A node is lost (a rank SIGKILLed at a random step) and the job restarts on 1 rank instead of 2, then it
    loses that rank too and restarts on 2 again. The global batch stays 4 (1 rank accumulates 2 microbatches of
    2), the sample sequence continues from the saved position, so every step matches the uninterrupted 2-rank
    run within the parity tolerances of test_parity_2d.py (sums in another order: not bitwise). The check has
    teeth: test_checkpoint.py's negative control shows a lost data position fails it."""
    rng = random.Random(int(os.environ.get("TORCHTITAN_FAULT_SEED", "0")) * 100 + 10)
    first, second = sorted(rng.sample(range(3, STEPS - 1), 2))
    folder = str(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outputs = []
    for nproc, fault in [(2, {"kind": "kill_rank", "step": first, "rank": rng.randrange(2)}),
                         (1, {"kind": "kill_rank", "step": second}), (2, None)]:
        env["TORCHTITAN_FAULTS"] = json.dumps([fault] if fault else [])
        result = subprocess.run(torchrun(nproc, [], folder), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, timeout=300)
        assert (result.returncode == 0) == (fault is None), result.stdout[-3000:]
        assert f"global batch 4 x seq 32, {2 // nproc} microbatch(es) per rank" in result.stdout
        outputs.append(result.stdout)
    runs = check_continuation(folder, outputs)
    steps = [m for run in runs for m in run]
    ref = [{"loss": reference[m["step"]][0], "grad_norm": reference[m["step"]][1]} for m in steps]
    assert_parity(curves(steps), curves(ref))
