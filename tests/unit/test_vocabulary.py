"""The one vocabulary rule of every family (protocols/model.py `job_vocab_size`): the model keeps its own
vocabulary (flavor, HF folder, override) when the tokenizer fits in it, padded rows included; a larger tokenizer
is refused in one line naming both sizes and the options that fix it. And the log's model line names where the
shape came from. Planned on the meta device: no weights, one process, seconds."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from torchtitan.config import ConfigError
from torchtitan.job_plan import plan_job
from torchtitan.models.common.qwen3_state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3 import qwen3_flavors
from torchtitan.protocols.model_shape import model_summary
from torchtitan.protocols.train_spec import _registered, config_manager

FAMILIES = sorted(name for name, spec in _registered().items() if "debugmodel_tiny" in spec.flavors)


def _cfg(*argv: str):
    return config_manager().parse_args(list(argv))


def test_the_four_families_are_covered():
    assert {"llama3", "qwen3", "qwen3_moe", "deepseek_v3"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_keeps_its_padded_rows_and_refuses_a_larger_tokenizer(family):
    cfg = _cfg("--model.name", family, "--model.flavor", "debugmodel_tiny")
    flavor_vocab = _registered()[family].flavors["debugmodel_tiny"].vocab_size
    smaller = SimpleNamespace(vocab_size=flavor_vocab - 37)
    assert plan_job(cfg, 1, smaller).model_args.vocab_size == flavor_vocab  # not shrunk to the tokenizer's
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, 1, SimpleNamespace(vocab_size=flavor_vocab + 37))
    message = str(e.value)
    assert "\n" not in message
    assert (f"the shipped tokenizer has {flavor_vocab + 37:,} tokens, more than the model's vocabulary of "
            f"{flavor_vocab:,} rows (flavor debugmodel_tiny)") in message
    assert f"--model.overrides vocab_size={flavor_vocab + 37}" in message and "--model.tokenizer_path" in message


def test_a_flavor_with_overrides_keeps_its_output_layer_and_the_log_says_so():
    """`--model.flavor 8B --model.overrides ...` with the shipped 2,048-token tokenizer trains the 8B's 128,256
    output rows (it used to shrink them to 2,048, silently)."""
    cfg = _cfg("--model.flavor", "8B", "--model.overrides", "n_layers=2,dim=256,n_heads=4,n_kv_heads=2")
    plan = plan_job(cfg, 1)
    assert plan.model_args.vocab_size == 128256 and plan.tokenizer.vocab_size == 2048
    assert model_summary(cfg, plan.model_args, plan.tokenizer) == (
        "Model llama3 (flavor 8B + overrides n_layers=2,dim=256,n_heads=4,n_kv_heads=2; vocabulary 128,256 rows "
        "for 2,048 tokens)"
    )
    shipped = _cfg("--model.flavor", "debugmodel_tiny")
    plan = plan_job(shipped, 1)
    assert model_summary(shipped, plan.model_args, plan.tokenizer) == "Model llama3 (flavor debugmodel_tiny)"


def test_an_hf_config_names_the_folder_in_the_log_and_in_the_refusal(tmp_path):
    for vocab in (2085, 2000):
        folder = tmp_path / str(vocab)
        folder.mkdir()
        args = dataclasses.replace(qwen3_flavors["debugmodel_tiny_untied"], vocab_size=vocab)
        (folder / "config.json").write_text(json.dumps(Qwen3StateDictAdapter.to_hf_config(args)))
    cfg = _cfg("--model.name", "qwen3", "--model.hf_config", str(tmp_path / "2085"), "--model.overrides", "n_layers=1")
    plan = plan_job(cfg, 1)
    assert plan.model_args.vocab_size == 2085
    line = model_summary(cfg, plan.model_args, plan.tokenizer)
    assert line == (f"Model qwen3 (the Hugging Face config {tmp_path / '2085'} + overrides n_layers=1; "
                    f"vocabulary 2,085 rows for 2,048 tokens)")
    assert "debugmodel" not in line  # the default flavor, which was not used
    with pytest.raises(ConfigError) as e:
        plan_job(_cfg("--model.name", "qwen3", "--model.hf_config", str(tmp_path / "2000")), 1)
    assert str(e.value) == (
        f"the shipped tokenizer has 2,048 tokens, more than the model's vocabulary of 2,000 rows (the Hugging Face "
        f"config {tmp_path / '2000'}): its ids past 1999 would have no embedding row; use the folder's own tokenizer "
        f"(--model.tokenizer_path {tmp_path / '2000'}), or give the model room for them with --model.overrides "
        f"vocab_size=2048"
    )
