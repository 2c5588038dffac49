"""The spike and non-finite guard under FSDP 2 (2 gloo ranks), proved against reference runs that do by hand
what the guard's action should amount to. A poisoned batch is injected at a seeded step through the
fault-injection hook (tools/fault_injection.py):

  skip      a 1e4x gradient on rank 0 -> that step's update is skipped; every loss and every later gradient norm
            equals, bitwise, a run without the guard whose gradients at that step are dropped (the optimizer then
            leaves weights and state alone, the LR schedule advances)
  rollback  a NaN gradient on rank 1 -> the run reloads its last checkpoint and leaves that step's data window
            out; the losses (the last logged value of each step) equal, bitwise, a run without the guard whose
            data stream never contained that window

Both decisions are taken on both ranks alike (else the ranks' collectives would part and the run hang), and
each event is a metrics.jsonl row."""

import functools
import json
import os
import random

import pytest

from tests.distributed.trainer_runs import read_metrics, train

pytestmark = pytest.mark.distributed

FSDP2 = ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]
# A short window judges the early, fast-moving curve; a threshold of 20 widens the loss's margin over the first
# steps' fast-falling loss, while the poisoned step (1e4x the gradient, over 100x its window's median, or NaN)
# is an event at any threshold.
GUARD = ["--guard.enable", "--guard.window", "4", "--guard.threshold", "20"]
STEPS = ["--training.steps", "8"]
SEED = int(os.environ.get("TORCHTITAN_FAULT_SEED", "0"))


def with_faults(faults, rank, world_size):
    os.environ["TORCHTITAN_FAULTS"] = json.dumps(faults)


def run(tmp_path, name, argv, faults):
    folder = str(tmp_path / name)
    train(2, FSDP2 + STEPS + argv, folder, setup=functools.partial(with_faults, faults))
    rows = read_metrics(folder)
    last = {m["step"]: (m["loss"], m["grad_norm"]) for m in rows if "loss" in m}  # a rollback logs steps again
    events = [m for m in rows if "guard/event" in m]
    return last, events


def test_skip_and_rollback_equal_their_reference_runs(tmp_path):
    rng = random.Random(SEED)
    bad = rng.randrange(6, 8)  # after the window (4 steps) is full; 8 steps in all
    skipped, events = run(tmp_path, "skip", GUARD, [{"kind": "poison_grad", "step": bad, "scale": 1e4, "rank": 0}])
    assert [(e["step"], e.get("guard/skip")) for e in events] == [(bad, 1.0)], events
    assert events[0]["guard/grad_norm"] > 1e3
    dropped, _ = run(tmp_path, "dropped", [], [{"kind": "drop_grad", "step": bad}])
    assert sorted(skipped) == sorted(dropped) == list(range(1, 9))
    for step in skipped:
        loss, norm = skipped[step]
        assert loss == dropped[step][0], f"step {step}: loss {loss!r} vs {dropped[step][0]!r} (bad step {bad})"
        if step != bad:  # at the bad step itself one run logs the poisoned norm, the other none
            assert norm == dropped[step][1], f"step {step}: grad norm {norm!r} vs {dropped[step][1]!r}"

    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0"]
    rolled, events = run(tmp_path, "rollback", GUARD + ["--guard.action", "rollback"] + ckpt,
                         [{"kind": "poison_grad", "step": bad, "scale": "nan", "rank": 1}])
    assert [(e["step"], e.get("guard/rollback")) for e in events] == [(bad, 1.0)], events
    never, _ = run(tmp_path, "never", [], [{"kind": "skip_data", "step": bad}])
    assert sorted(rolled) == sorted(never) == list(range(1, 9))
    assert rolled == never, f"bad step {bad}: " + ", ".join(
        f"{s}: {rolled[s]} vs {never[s]}" for s in rolled if rolled[s] != never[s])
    assert skipped[bad + 1] != never[bad + 1]  # teeth: leaving a window out changes the run
