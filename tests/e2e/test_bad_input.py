"""Malformed input through ./run_train.sh, as a user meets it: one line starting with `error:`, exit code 1, no
traceback (neither a rank's nor torchrun's ChildFailedError report), with 1 and 2 processes.

Inputs the pre-flight check judges stop before torchrun starts (seconds); two of them go through the launcher
here, the full list is judged in-process in tests/unit/test_job_checks.py. The inputs only a rank can judge (a
checkpoint step that does not exist, a data file that does not parse, a learning rate that diverges) pass the
pre-flight check and get their line from the trainer, in-process; one of them also goes through torchrun and the
launcher (torchtitan/launch.py), which prints the rank's line once. A real crash keeps torchrun's report."""

import os
import subprocess
import sys

import pytest

from tests.e2e.test_run_train import ROOT, run

pytestmark = pytest.mark.e2e

TINY = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "3", "--validation.enable", "false", "--eval.enable", "false", "--metrics.log_freq", "1"]


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_input")
    (root / "broken.jsonl").write_text('{"text": "fine"}\n{"text": broken\n{"text": "fine"}\n')
    _llama_folder(root / "vocab2000", config_vocab=2000, weights_vocab=None)  # config.json only
    _llama_folder(root / "mismatch", config_vocab=2085, weights_vocab=2048)  # weights of another vocabulary
    return root


def _llama_folder(folder, config_vocab: int, weights_vocab: int | None) -> None:
    """An HF Llama folder of the tiny shape whose config.json says `config_vocab` rows and whose weights (zeros,
    only their shapes matter) have `weights_vocab`."""
    import dataclasses
    import json

    import torch
    from safetensors.torch import save_file

    from torchtitan.models.llama3 import llama3_flavors
    from torchtitan.models.llama3.model import Transformer
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    folder.mkdir()
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], vocab_size=config_vocab)
    (folder / "config.json").write_text(json.dumps(Llama3StateDictAdapter.to_hf_config(args, torch.float32)))
    if weights_vocab is not None:
        with torch.device("meta"):
            model = Transformer(dataclasses.replace(args, vocab_size=weights_vocab))
        hf = Llama3StateDictAdapter(args).to_hf({k: torch.zeros(v.shape) for k, v in model.state_dict().items()})
        save_file(hf, str(folder / "model.safetensors"))


def assert_one_clean_line(p, message):
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], p.stderr[-2000:]
    for stream in (p.stdout, p.stderr):
        assert "Traceback" not in stream and "ChildFailedError" not in stream, stream[-3000:]


PREFLIGHT_CASES = [  # (args, processes, message): issue 31's two, through the launcher with 1 and 2 processes.
    # Every other input the pre-flight check judges is tested in-process (tests/unit/test_job_checks.py,
    # test_preflight.py): a launch costs seconds of interpreter start-up and proves nothing more.
    (["--model.hf_config", "{bad}/vocab2000"], 1,
     "the shipped tokenizer has 2,048 tokens, more than the model's vocabulary of 2,000 rows (the Hugging Face config "
     "{bad}/vocab2000)"),
    (["--model.hf_config", "{bad}/mismatch", "--checkpoint.enable", "--checkpoint.initial_load_path", "{bad}/mismatch",
      "--checkpoint.initial_load_in_hf"], 2,
     "{bad}/mismatch: model.embed_tokens.weight is [2048, 64] in its safetensors, [2085, 64] by its config.json"),
]


@pytest.mark.parametrize("args, ngpu, message", PREFLIGHT_CASES, ids=["tokenizer_over_vocab-1", "weights_vs_config-2"])
def test_inputs_judged_before_ranks_start(bad, tmp_path, args, ngpu, message):
    args = [a.format(bad=bad) for a in args]
    p = run(["--job.dump_folder", str(tmp_path / "run"), *TINY, *args], ngpu=ngpu, timeout=300)
    assert_one_clean_line(p, message.format(bad=bad))
    assert "Starting job" not in p.stdout  # stopped by the pre-flight check, no rank started


RANK_CASES = {  # id: (args, message): inputs only a rank can tell.
    "load_step": (["--checkpoint.enable", "--checkpoint.load_step", "7"], "--checkpoint.load_step 7: "),
    "broken_jsonl": (["--training.dataset", "local", "--training.dataset_path", "{bad}/broken.jsonl"],
                     "{bad}/broken.jsonl:2: not valid JSON"),
    "diverging_lr": (["--optimizer.lr", "1e12", "--lr_scheduler.warmup_steps", "0"],
                     "loss or gradients became non-finite at step"),
}


@pytest.mark.parametrize("case", list(RANK_CASES))
def test_a_ranks_user_error_passes_preflight_and_is_one_line(bad, tmp_path, capsys, case):
    """In-process (a launch costs tens of seconds under CI's load and proves nothing more per input): the pre-flight
    check of a 2-process job passes the input, so only a rank can tell, and the trainer refuses it in one line,
    exit 1, no traceback. The launcher's path for such a line is the same for every input: the next test."""
    from torchtitan import preflight
    from torchtitan.train import main

    args, message = RANK_CASES[case]
    argv = ["--job.dump_folder", str(tmp_path / "run"), *TINY, *[a.format(bad=bad) for a in args]]
    assert preflight.main(["--world-size", "2", *argv]) == 0, capsys.readouterr().err[-2000:]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message.format(bad=bad) in errors[0], err[-2000:]
    assert "Traceback" not in err


def test_a_ranks_user_error_is_one_line_without_torchruns_report(tmp_path):
    """Through the launcher with two processes: every rank raises the error of the input (a diverging learning
    rate, judged at the first step), the launcher prints the rank's line once and hides torchrun's report."""
    args, message = RANK_CASES["diverging_lr"]
    p = run(["--job.dump_folder", str(tmp_path / "run"), *TINY, *args], ngpu=2, timeout=300)
    assert "Starting job" in p.stdout  # a rank judged it, not the pre-flight check
    assert_one_clean_line(p, message)


def test_a_real_crash_keeps_torchruns_report():
    # One rank: with two, torchrun stops the second as soon as the first fails, and once in a CI run (under
    # load) neither rank's traceback reached the output; the report itself is the same for one rank.
    p = subprocess.run(
        [sys.executable, "-m", "torchtitan.launch", "--nproc_per_node=1", "--rdzv_backend", "c10d",
         "--rdzv_endpoint=localhost:0", "--no-python", sys.executable, "-c", "raise RuntimeError('boom')"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120,
    )
    out = p.stderr + p.stdout
    assert p.returncode != 0, out
    assert "ChildFailedError" in p.stderr and "Root Cause" in p.stderr and "exitcode  : 1" in p.stderr, out
    assert "RuntimeError: boom" in out, out


def test_an_expert_parallel_recipe_on_one_process_says_how_to_run_it(tmp_path, capsys):
    """`CONFIG_FILE=train_configs/debug_moe.toml ./run_train.sh` on one process: the launcher's pre-flight call
    (`--world-size 1 --job.config_file <CONFIG_FILE>`), in-process."""
    from torchtitan import preflight

    code = preflight.main(["--world-size", "1", "--job.config_file", "train_configs/debug_moe.toml",
                           "--job.dump_folder", str(tmp_path / "run")])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1, errors
    assert ("to keep expert_parallel_degree 2, run a multiple of 2 processes (NGPU=2 ./run_train.sh), "
            "or set --parallelism.expert_parallel_degree 1 (no expert parallel) for 1 process") in errors[0]
