"""Hugging Face interop and generation from checkpoints, with no `transformers`: conversion is exact both ways,
a converted folder computes the exported model's logits, and the trainer can start from either."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.tolerances import contraction_width, logits_tol
from tests.unit.checkpoint_helpers import inventory, losses, run
from tests.unit.test_state_dict_adapter import hf_llama_forward
from torchtitan.components.checkpoint.manager import CheckpointError
from torchtitan.components.checkpoint.offline_model import build_cpu_model, job_config_of, load_model_weights

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoints"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402
import generate  # noqa: E402


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    assert run(folder, "--training.steps", "3", "--checkpoint.enable", "--checkpoint.interval", "10",
               "--checkpoint.last_save", "export_only") == 0
    return str(folder / "checkpoint" / "export-step-3")


@pytest.fixture(scope="module")
def hf_folder(export, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "hf")
    assert convert_to_hf.main([export, out]) == 0
    return out


def load(checkpoint, *overrides):
    cfg = job_config_of(checkpoint, list(overrides))
    model, spec, _, args = build_cpu_model(cfg)
    load_model_weights(model, checkpoint, spec.state_dict_adapter, args)
    return model, spec, args


def test_round_trip_is_exact(export, hf_folder, tmp_path):
    ours, spec, args = load(export)
    assert sorted(os.listdir(hf_folder)) == ["config.json", "generation_config.json", "model.safetensors",
                                          "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    hf = load_file(os.path.join(hf_folder, "model.safetensors"))
    expected = spec.state_dict_adapter(args).to_hf(ours.state_dict())
    assert sorted(hf) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(hf[key], value), key
    back = str(tmp_path / "dcp")
    assert convert_from_hf.main([hf_folder, back, "--job.config_file", os.path.join(export, "config.toml")]) == 0
    again, _, _ = load(back, "--job.config_file", os.path.join(export, "config.toml"))
    for key, value in ours.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_converted_folder_gives_the_exported_logits(export, hf_folder):
    ours, _, _ = load(export)
    from_hf, _, _ = load(hf_folder, "--job.config_file", os.path.join(export, "config.toml"))
    tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(tokens)
        assert torch.equal(from_hf(tokens), expected)
        with open(os.path.join(hf_folder, "config.json")) as f:
            config = json.load(f)
        # An independent Llama in HF conventions (rotate_half RoPE, HF names) on the safetensors file itself.
        hf_logits = hf_llama_forward(load_file(os.path.join(hf_folder, "model.safetensors")), config, tokens)
    # Two float32 forward passes (the test's own HF-convention Llama). Measured: uses 0.002 of it (AVX-512), 0.002 (AVX2
    # caps).
    torch.testing.assert_close(hf_logits, expected,
                               **logits_tol(expected, len(ours.layers), contraction_width(ours, tokens.shape[1])))


def test_training_starts_from_hf_like_from_the_export(export, hf_folder, tmp_path):
    assert run(tmp_path / "dcp", "--training.steps", "2", "--checkpoint.initial_load_path", export) == 0
    assert run(tmp_path / "hf", "--training.steps", "2", "--checkpoint.initial_load_path", hf_folder,
               "--checkpoint.initial_load_in_hf") == 0
    assert losses(tmp_path / "hf") == losses(tmp_path / "dcp")


def test_hf_folder_of_another_shape_is_refused(hf_folder, tmp_path, capsys):
    before = inventory(hf_folder)
    assert run(tmp_path, "--training.steps", "1", "--model.flavor", "debugmodel",
               "--checkpoint.initial_load_path", hf_folder, "--checkpoint.initial_load_in_hf") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    # The folder's config.json is compared with the model first: one line naming each differing setting.
    assert len(err) == 1 and "config.json does not match the model: hidden_size " in err[0], err
    assert inventory(hf_folder) == before


def test_conversion_refuses_bad_input(export, tmp_path, capsys):
    assert convert_to_hf.main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 1
    assert "no such folder" in capsys.readouterr().err
    assert convert_from_hf.main([export, str(tmp_path / "out")]) == 1
    assert "not a Hugging Face folder" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="another model shape"):
        load(export, "--model.flavor", "debugmodel")


def test_generate_greedy_and_sampled(export, hf_folder, capsys):
    argv = ["--prompt", "The os module", "--max_new_tokens", "8"]
    assert generate.main([export, *argv]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith("The os module")
    assert generate.main([hf_folder, *argv, "--job.config_file", os.path.join(export, "config.toml")]) == 0
    assert capsys.readouterr().out == greedy, "HF folder and export generate the same text"
    assert generate.main([export, *argv, "--temperature", "1.0", "--top_k", "1"]) == 0
    assert capsys.readouterr().out == greedy, "top_k 1 is greedy"
    sampled = []
    for _ in range(2):
        assert generate.main([export, *argv, "--temperature", "1.0", "--top_k", "50", "--seed", "3"]) == 0
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1], "sampling is reproducible under a seed"
