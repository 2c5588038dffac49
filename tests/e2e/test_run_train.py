"""The real entry point, as a user runs it: ./run_train.sh (torchrun), read back the run folder and exit code."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def run(args, *, ngpu=1, env_extra=None, timeout=600):
    env = dict(os.environ, NGPU=str(ngpu), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline")
    env.update(env_extra or {})
    return subprocess.run(
        ["./run_train.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_two_process_cpu_run_trains_and_writes_its_run_folder(tmp_path):
    """The default recipe's path (auto precision, validation, evaluation, TensorBoard) on the tiny flavor: seconds of
    training on any CPU, whatever dtype auto picks there."""
    dump = tmp_path / "run"
    p = run(
        ["--job.dump_folder", str(dump), "--model.flavor", "debugmodel_tiny", "--training.steps", "20",
         "--training.seq_len", "64", "--training.local_batch_size", "4", "--metrics.log_freq", "5",
         "--validation.freq", "20", "--validation.steps", "2", "--metrics.enable_tensorboard",
         "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps", "2"],
        ngpu=2,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "Precision: mixed_precision_param auto -> " in p.stdout
    lines = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "loss" in m]
    assert [m["step"] for m in train] == [1, 5, 10, 15, 20]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [m["loss"] for m in train]
    assert all(0 < m["mfu"] <= 100 and "mfu_above_100" not in m for m in train[1:])
    val = [m for m in lines if "validation/loss" in m]
    assert len(val) == 1 and val[0]["step"] == 20
    # The recipe's [eval]: the shipped task scored at the last step, over both ranks (25 documents, 100 requests).
    ev = [m for m in lines if "eval/stdlib_next_line/acc" in m]
    assert len(ev) == 1 and ev[0]["step"] == 20 and ev[0]["eval/stdlib_next_line/requests"] == 100, ev
    assert 0.0 <= ev[0]["eval/stdlib_next_line/acc"] <= 1.0 and ev[0]["eval/stdlib_next_line/acc_stderr"] > 0
    assert (dump / "config.toml").read_text().count("steps = 20") == 1
    assert any((dump / "tb").rglob("events.out.tfevents.*"))


BAD_INPUT = [
    (["--training.stepz", "3"], 2, "unknown option --training.stepz; did you mean --training.steps?"),
    (["--training.steps", "ten"], 2, "--training.steps expects an int, got 'ten'"),
    (["--model.flavor", "debugmodle"], 1, "unknown flavor 'debugmodle'"),
    (["--parallelism.tensor_parallel_degree", "3"], 1, "world size 1 is not divisible"),
    (["--model.tokenizer_path", "/nonexistent/tok.model"], 1, "/nonexistent/tok.model"),
    (["--training.enable_cpu_offload"], 1, "enable_cpu_offload moves GPU memory to the host: it needs CUDA"),
]


def assert_one_line(code, stderr, exit_code, message, dump):
    assert code == exit_code, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], stderr
    assert "Traceback" not in stderr
    assert not dump.exists()  # rejected before anything was written


@pytest.mark.parametrize("args,exit_code,message", BAD_INPUT, ids=[a[0] for a, _, _ in BAD_INPUT])
def test_bad_input_gets_one_clear_line(tmp_path, capsys, args, exit_code, message):
    """What ./run_train.sh runs before torchrun (the pre-flight check, below through the launcher once), called
    in-process: a launch per case costs seconds of interpreter start-up and adds nothing the launcher case
    does not show."""
    from torchtitan import preflight

    code = preflight.main(["--world-size", "1", "--job.config_file", "train_configs/debug_model.toml",
                           "--job.dump_folder", str(tmp_path / "bad"), *args])
    assert_one_line(code, capsys.readouterr().err, exit_code, message, tmp_path / "bad")


def test_the_launcher_stops_on_the_preflight_line_with_its_exit_code(tmp_path):
    """run_train.sh passes the pre-flight check's exit code (2: the parser's) and its one line on, and starts no
    rank; the pre-flight check's other lines are tested in-process above."""
    args, exit_code, message = BAD_INPUT[0]
    p = run(["--job.dump_folder", str(tmp_path / "bad"), *args], ngpu=1, timeout=300)
    assert_one_line(p.returncode, p.stderr, exit_code, message, tmp_path / "bad")
    assert "Starting job" not in p.stdout


def test_help_after_other_arguments_shows_the_sections_they_select():
    """The launcher's --help (issue 31: it dropped the arguments before --help, so [moe] was missing)."""
    p = run(["--model.name", "qwen3_moe", "--help"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "\n[moe]\n" in p.stdout and "--moe.load_balance_coeff" in p.stdout
    assert "--training.mixed_precision_param" in p.stdout and "--parallelism.data_parallel_shard_degree" in p.stdout


@pytest.mark.parametrize("recipe, has_moe", [("train_configs/debug_model.toml", False),
                                             ("train_configs/debug_moe.toml", True)], ids=["default", "moe_recipe"])
def test_help_shows_the_sections_the_recipe_selects(capsys, recipe, has_moe):
    """In-process: run_train.sh turns CONFIG_FILE into --job.config_file before --help (the launcher case above)."""
    from torchtitan.train import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--job.config_file", recipe, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--training.mixed_precision_param" in out
    assert ("\n[moe]\n" in out and "--moe.load_balance_coeff" in out) == has_moe  # llama3 brings no section
