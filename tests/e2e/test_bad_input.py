"""Malformed input through ./run_train.sh, as a user meets it: one line starting with `error:`, exit code 1, no
traceback (neither a rank's nor torchrun's ChildFailedError report), with 1 and 2 processes.

Inputs the pre-flight check judges stop before torchrun starts (seconds); two of them go through the launcher
here, the full list is judged in-process in tests/unit/test_job_checks.py. The inputs only a rank can judge (a
checkpoint step that does not exist, a data file that does not parse, a learning rate that diverges) go through
torchrun and the launcher (torchtitan/launch.py), which prints the rank's line once. A real crash keeps torchrun's report."""

import os
import subprocess
import sys

import pytest

from tests.e2e.test_run_train import ROOT, run

pytestmark = pytest.mark.e2e

TINY = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.steps", "3", "--validation.enable", "false", "--metrics.log_freq", "1"]


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


RANK_CASES = [  # (args, processes, message): only a rank can tell. Two processes: the launcher's path is the same
    # for any count (one rank: test_a_real_crash_keeps_torchruns_report), and each torchrun start costs seconds.
    (["--checkpoint.enable", "--checkpoint.load_step", "7"], 2, "--checkpoint.load_step 7: "),
    (["--training.dataset", "local", "--training.dataset_path", "{bad}/broken.jsonl"], 2,
     "{bad}/broken.jsonl:2: not valid JSON"),
    (["--optimizer.lr", "1e12", "--lr_scheduler.warmup_steps", "0"], 2, "loss or gradients became non-finite at step"),
]


@pytest.mark.parametrize("args, ngpu, message", RANK_CASES, ids=["load_step-2", "broken_jsonl-2",
                                                                 "diverging_lr-2"])
def test_a_ranks_user_error_is_one_line_without_torchruns_report(bad, tmp_path, args, ngpu, message):
    args = [a.format(bad=bad) for a in args]
    p = run(["--job.dump_folder", str(tmp_path / "run"), *TINY, *args], ngpu=ngpu, timeout=300)
    assert "Starting job" in p.stdout  # a rank judged it, not the pre-flight check
    assert_one_clean_line(p, message.format(bad=bad))


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
