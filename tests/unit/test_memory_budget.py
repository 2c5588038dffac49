"""The memory budget planner: its search is exact, its refusals are one line, its plans train like no-AC.

Exact: on 400 random instances (1-5 blocks, unequal bytes and seconds per choice of all five, full_offload
included; budgets from nothing fits to everything fits, given as a cap on kept + transient bytes or, as the
estimator gives them, as a cap on kept bytes for each largest transient), `solve` finds the same plan as trying
every combination.
"""

import json
import random

import pytest

from torchtitan.job_plan import plan_job
from torchtitan.planning.memory_budget import (
    CHOICES,
    BlockCost,
    activation_bytes,
    brute_force,
    least_bytes,
    plan_budget,
    plan_seconds,
    resolve_budget,
    solve,
)
from torchtitan.protocols.train_spec import config_manager
from torchtitan.train import main

TINY = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "256", "--training.local_batch_size", "4",
        "--training.mixed_precision_param", "float32", "--training.steps", "3", "--metrics.log_freq", "1",
        "--debug.seed", "3", "--debug.deterministic"]


def _random_blocks(rng: random.Random, n: int) -> list[BlockCost]:
    blocks = []
    for _ in range(n):
        unit = rng.choice([1, 2, 3, 8])
        full = unit * rng.randint(1, 4)
        op = full + unit * rng.randint(0, 12)
        keep = op + unit * rng.randint(0, 12)
        recompute = rng.uniform(0.2, 1.0)
        seconds = (0.0, rng.uniform(0, 0.3), recompute, rng.uniform(0, 1.5), recompute + rng.uniform(0, 0.5))
        transient = (0, keep - op, keep - full, rng.choice([1, 2]) * keep, keep)
        blocks.append(BlockCost((keep, op, full, 0, 0), seconds, transient))
    return blocks


def _random_room(rng: random.Random, blocks: list[BlockCost]):
    """A cap on kept + transient bytes, or (as planning/memory.py's peak gives it) on kept bytes for each
    largest transient: the transient counts in part (the start of backward, without it, may be the peak)."""
    room = rng.randint(0, sum(b.bytes[0] for b in blocks) + 10)
    if rng.random() < 0.5:
        return room
    share, floor = rng.choice([0.0, 0.5, 1.0]), rng.randint(0, 10)
    return lambda t: max(-1, min(room - floor, int(room - share * t)))


def test_solve_equals_brute_force_on_a_random_family():
    rng = random.Random(0)
    feasible = infeasible = mixed = inputs_offloaded = 0
    for _ in range(400):
        blocks = _random_blocks(rng, rng.randint(1, 5))
        allowed = CHOICES if rng.random() < 0.7 else tuple(c for c in CHOICES if rng.random() < 0.7) or ("keep",)
        room = _random_room(rng, blocks)
        got, want = solve(blocks, room, allowed), brute_force(blocks, room, allowed)
        assert (got is None) == (want is None), (blocks, room)
        if want is None:
            infeasible += 1
            if not callable(room):
                assert least_bytes(blocks, allowed) > room
            continue
        feasible += 1
        mixed += len(set(want.choices)) > 1
        inputs_offloaded += "full_offload" in want.choices
        assert got.choices == want.choices, (blocks, room, got, want)
        assert got.seconds == want.seconds and got.activation_bytes == want.activation_bytes
        assert got.kept_bytes <= (room(got.transient_bytes) if callable(room) else room - got.transient_bytes)
        assert got.exact
        if not callable(room):
            assert least_bytes(blocks, allowed) <= room
    # the family exercises every branch
    assert feasible > 100 and infeasible > 10 and mixed > 100 and inputs_offloaded > 20


def _greedy(blocks: list[BlockCost], room: int):
    """Start from keep everywhere; while over the room, take the change that frees the most bytes per second."""
    choices = ["keep"] * len(blocks)
    while activation_bytes(blocks, tuple(choices)) > room:
        used = activation_bytes(blocks, tuple(choices))
        options = []
        for i, b in enumerate(blocks):
            for c in CHOICES:
                trial = tuple(choices[:i] + [c] + choices[i + 1:])
                freed = used - activation_bytes(blocks, trial)
                extra = plan_seconds(blocks, trial) - plan_seconds(blocks, tuple(choices))
                if freed > 0:
                    options.append((freed / max(extra, 1e-9), trial))
        if not options:
            return None
        choices = list(max(options)[1])
    return tuple(choices)


def test_the_check_catches_a_greedy_rule():
    """Negative control: the same comparison with brute force fails a greedy search on this family."""
    rng = random.Random(0)
    wrong = 0
    for _ in range(400):
        blocks = _random_blocks(rng, rng.randint(1, 5))
        room = rng.randint(0, sum(b.bytes[0] for b in blocks) + 10)
        want = brute_force(blocks, room)
        if want is not None and _greedy(blocks, room) != want.choices:
            wrong += 1
    assert wrong > 20


def _plan(tmp_path, *extra):
    cfg = config_manager().parse_args(TINY + ["--job.dump_folder", str(tmp_path), *extra])
    return cfg, plan_job(cfg, 1)


@pytest.fixture(scope="module")
def extremes(tmp_path_factory):
    """(peak when every block keeps, the least budget any plan meets) of the tiny job."""
    tmp = tmp_path_factory.mktemp("extremes")
    cfg, plan = _plan(tmp, "--memory.budget_gib", "100")
    keep = plan_budget(cfg, plan, flops=1e11).memory.peak
    cfg, plan = _plan(tmp, "--memory.budget_gib", "0.004")  # above the parameters (2 MiB), below the least
    with pytest.raises(ValueError) as e:
        plan_budget(cfg, plan, flops=1e11)
    least = float(str(e.value).split("needs is ")[1].split(" GiB")[0])
    return keep / 2**30, least


def test_refusal_names_the_least_budget_that_works(extremes, tmp_path):
    keep, least = extremes
    assert least < keep
    cfg, plan = _plan(tmp_path, "--memory.budget_gib", str(least))
    met = plan_budget(cfg, plan, flops=1e11)
    assert met.memory.peak <= least * 2**30
    assert set(met.choices) <= {"full", "offload", "full_offload"}


def _losses(folder):
    with open(folder / "metrics.jsonl") as f:
        return [m["loss"] for m in map(json.loads, f) if "loss" in m]


@pytest.fixture(scope="module")
def no_ac_losses(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ref")
    main(TINY + ["--job.dump_folder", str(folder)])
    return _losses(folder)


def test_budget_between_extremes_mixes_choices_and_trains_like_no_ac(extremes, no_ac_losses, tmp_path, capsys):
    keep, least = extremes
    budget = f"{(keep + least) / 2:.4f}"
    argv = TINY + ["--job.dump_folder", str(tmp_path / "planned"), "--memory.budget_gib", budget,
                   "--memory.offload_dir", str(tmp_path)]
    cfg, resolved = resolve_budget(config_manager().parse_args(argv), 1)
    assert set(resolved.choices) != {"keep"} and resolved.memory.peak <= float(budget) * 2**30
    assert main(argv) == 0
    assert "memory plan for a budget of" in capsys.readouterr().out

    assert len(no_ac_losses) == 3 and _losses(tmp_path / "planned") == no_ac_losses  # bitwise


def test_a_budget_only_optimizer_offload_meets_offloads_it_and_trains_like_no_ac(extremes, no_ac_losses, tmp_path,
                                                                                  capsys):
    """Below what any plan of the blocks alone needs, the planner also offloads the optimizer state (its bytes
    leave the estimate, its moves join the step); the run's losses stay bitwise no-AC's."""
    _, least = extremes
    cfg, plan = _plan(tmp_path, "--memory.budget_gib", "0.004", "--memory.plan_choices", "keep,op,full,offload")
    with pytest.raises(ValueError) as e:
        plan_budget(cfg, plan, flops=1e11)
    blocks_only = float(str(e.value).split("needs is ")[1].split(" GiB")[0])
    assert least < blocks_only  # the optimizer state's bytes, less the chunks it keeps in RAM
    budget = f"{(least + blocks_only) / 2:.4f}"
    argv = TINY + ["--job.dump_folder", str(tmp_path / "planned"), "--memory.budget_gib", budget,
                   "--memory.offload_dir", str(tmp_path)]
    resolved_cfg, resolved = resolve_budget(config_manager().parse_args(argv), 1)
    assert resolved.offload_optimizer and resolved_cfg.memory.offload_optimizer
    assert resolved.memory.peak <= float(budget) * 2**30 and resolved_cfg.memory.cpu_return_freed
    assert main(argv) == 0
    assert "optimizer state offloaded to files" in capsys.readouterr().out
    assert _losses(tmp_path / "planned") == no_ac_losses  # bitwise


@pytest.mark.parametrize("extra, says", [
    (["--memory.budget_gib", "-1"], "--memory.budget_gib must be 0 (no budget) or a positive number of GiB, got -1.0"),
    (["--memory.budget_gib", "0.00001"], "is below this rank's own parameters"),
    (["--memory.budget_gib", "0.004"],
     "cannot be met: the least any plan of keep/op/full/offload/full_offload per block needs is"),
    (["--memory.budget_gib", "1", "--activation_checkpoint.mode", "full"],
     "decides recomputation per block and cannot compose with --activation_checkpoint.mode full: set it to none"),
    (["--memory.block_choices", "offload", "--activation_checkpoint.mode", "memory_budget", "--compile.enable"],
     "cannot compose with --activation_checkpoint.mode memory_budget"),
    (["--memory.offload_optimizer", "--checkpoint.enable"],
     "--memory.offload_optimizer keeps the optimizer state in files between steps, which checkpointing does not"),
    (["--memory.offload_optimizer", "--optimizer.name", "Muon"], "Muon (whole-matrix steps across ranks) cannot"),
])
def test_bad_input_fails_in_one_line_before_any_rank(extra, says, tmp_path, capsys):
    """The launcher's pre-flight check (run before torchrun starts a rank) refuses with one line."""
    from torchtitan.preflight import main as preflight

    assert preflight(TINY + ["--job.dump_folder", str(tmp_path), *extra]) == 1
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_preflight_prints_the_plan(tmp_path, capsys):
    from torchtitan.preflight import main as preflight

    assert preflight(TINY + ["--job.dump_folder", str(tmp_path), "--memory.budget_gib", "100"]) == 0
    out = capsys.readouterr().out
    assert "memory plan for a budget of 100.00 GiB per rank: blocks 0-1 keep; predicted peak" in out, out


def test_dry_run_plans_an_8b_layout_for_a_budget(capsys):
    """The dry run takes the budget: Llama 3 8B on 8 H100s (FSDP 8), seq 8192, planned under 40 GiB (no AC
    needs more), and refused under 16 GiB with the least that works."""
    from torchtitan.dry_run import main as dry_run_main

    layout = ["--world-size", "8", "--ranks", "0", "--device-type", "H100-80GB", "--model.flavor", "8B",
              "--training.seq_len", "8192", "--training.local_batch_size", "1",
              "--training.mixed_precision_param", "bfloat16", "--model.tokenizer_path", "/nonexistent"]
    dry_run_main(layout + ["--memory.budget_gib", "1000", "--memory.plan_choices", "keep"])
    keep = float(capsys.readouterr().out.split("predicted peak ")[1].split(" GiB")[0])
    assert keep > 40
    dry_run_main(layout + ["--memory.budget_gib", "40"])
    out = capsys.readouterr().out
    assert "memory plan for a budget of 40.00 GiB per rank: blocks 0-" in out, out
    assert float(out.split("predicted peak ")[1].split(" GiB")[0]) <= 40
    dry_run_main(layout + ["--memory.budget_gib", "16"])
    out = capsys.readouterr().out
    assert "error: --memory.budget_gib 16.0 cannot be met: the least any plan" in out, out
