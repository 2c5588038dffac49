"""A LoRA run's checkpoints hold the adapters, their optimizer state and the training state, and refer to the
frozen base by path and fingerprint: on the Qwen3 debug model one is a few percent of a full checkpoint's
bytes, the run resumes from it bit for bit, and a resume against another base is refused in one line."""

import json
import os
import shutil

import pytest

from torchtitan.train import main

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel", "--training.seq_len", "64",
         "--training.local_batch_size", "2", "--training.mixed_precision_param", "float32", "--debug.seed", "3",
         "--debug.deterministic", "--metrics.log_freq", "1", "--checkpoint.enable", "--checkpoint.interval", "2"]
LORA = ["--model.converters", "lora", "--lora.rank", "8", "--optimizer.lr", "1e-2"]


def _run(folder, *argv):
    assert main(QWEN3 + list(argv) + ["--job.dump_folder", str(folder)]) == 0


def _losses(folder):
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return {m["step"]: (m["loss"], m["grad_norm"]) for m in map(json.loads, f) if "loss" in m}


def _bytes(folder):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    _run(folder, *LORA, "--training.steps", "4")
    return folder


def test_lora_checkpoint_is_small_and_names_its_base(lora_run, tmp_path):
    _run(tmp_path, "--training.steps", "1")
    full = _bytes(tmp_path / "checkpoint" / "step-1")
    lora = _bytes(lora_run / "checkpoint" / "step-2")
    print(f"Qwen3 debugmodel checkpoint bytes: full {full:,}, LoRA rank 8 on the attention projections {lora:,} ({100 * lora / full:.2f}%)")
    assert lora <= 0.05 * full
    with open(lora_run / "checkpoint" / "step-2" / "manifest.json") as f:
        base = json.load(f)["base"]
    assert "seed 3" in base["path"] and len(base["fingerprint"]) == 64


def test_lora_run_resumes_bitwise(lora_run, tmp_path):
    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(lora_run / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    _run(tmp_path, *LORA, "--training.steps", "4")
    straight, resumed = _losses(lora_run), _losses(tmp_path)
    assert sorted(resumed) == [3, 4]
    assert [resumed[s] for s in (3, 4)] == [straight[s] for s in (3, 4)]


def test_resume_against_another_base_is_refused_in_one_line(lora_run, tmp_path, capsys):
    os.makedirs(tmp_path / "checkpoint")
    shutil.copytree(lora_run / "checkpoint" / "step-2", tmp_path / "checkpoint" / "step-2")
    # Another seed initialises another base model.
    argv = QWEN3 + LORA + ["--training.steps", "4", "--debug.seed", "4", "--job.dump_folder", str(tmp_path)]
    assert main(argv) == 1
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert len(err) == 1 and "was trained on base" in err[0] and "has fingerprint" in err[0], err
