"""An MoE run started from a Hugging Face folder exports back to that format with default options, and a save
the run could not make is refused before any step.

Qwen3-MoE, Qwen3.5-MoE and GPT-OSS routers have no balancing bias in their Hugging Face format. A random
transformers model of each (save_pretrained) is trained 3 steps by the real entry point (torchtitan.train.main,
one process) with its shape and weights from the folder and `--checkpoint.last_save hf_only`: unset,
--moe.load_balance_coeff resolves to 0 and the routers are balanced by transformers' load-balancing loss with
the folder's router_aux_loss_coef; the written folder loads with AutoModelForCausalLM and holds the trained
routers. The same command with --moe.load_balance_coeff 1e-3 (command line or TOML) is refused by the
pre-flight check in one line. DeepSeek-V3's format keeps the bias (e_score_correction_bias): not refused.
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan import preflight  # noqa: E402
from torchtitan.job_plan import plan_job  # noqa: E402
from torchtitan.protocols.train_spec import _registered, config_manager  # noqa: E402
from torchtitan.train import main as train_main  # noqa: E402

VOCAB = 2048  # the shipped tokenizer's
STEPS = 3
FAMILIES = {
    # name: (transformers config class, config, our router weight's HF name in layer 0)
    "qwen3_5": ("Qwen3_5MoeTextConfig", dict(
        hidden_size=48, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, max_position_embeddings=64),
        "model.layers.0.mlp.gate.weight"),
    "gpt_oss": ("GptOssConfig", dict(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64),
        "model.layers.0.mlp.router.weight"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
        max_position_embeddings=64), "model.layers.0.mlp.gate.weight"),
}
COMMON = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
          "--training.mixed_precision_param", "float32", "--optimizer.lr", "1e-2", "--lr_scheduler.warmup_steps",
          "1", "--metrics.log_freq", "1", "--checkpoint.export_dtype", "float32"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, (cls, kwargs, _) in FAMILIES.items():
        folder = str(tmp_path_factory.mktemp(name))
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(vocab_size=VOCAB, **kwargs))
        model.save_pretrained(folder)  # output_router_logits false, router_aux_loss_coef the class default
        out[name] = folder
    return out


def _argv(name: str, folder: str, dump) -> list[str]:
    return COMMON + ["--model.name", name, "--model.hf_config", folder, "--checkpoint.initial_load_path", folder,
                     "--checkpoint.initial_load_in_hf", "--checkpoint.enable", "--checkpoint.last_save", "hf_only",
                     "--job.dump_folder", str(dump)]


def _weight(folder: str, key: str) -> torch.Tensor:
    from safetensors import safe_open

    for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
        with safe_open(os.path.join(folder, file), "pt") as f:
            if key in f.keys():
                return f.get_tensor(key)
    raise KeyError(key)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_hf_moe_folder_in_trains_and_exports_by_default(name, folders, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHTITAN_CACHE_DIR", str(tmp_path / "cache"))
    folder = folders[name]
    coef = json.load(open(os.path.join(folder, "config.json")))["router_aux_loss_coef"]
    argv = _argv(name, folder, tmp_path / "run")
    assert preflight.main(argv) == 0
    plan = plan_job(config_manager().parse_args(argv), 1)
    assert plan.model_args.moe.load_balance_coeff == 0 and plan.model_args.moe.router_aux_loss_coef == coef > 0
    assert "router has no balancing bias" in plan.moe_balancing.why and str(coef) in plan.moe_balancing.why

    assert train_main(argv) == 0
    out = str(tmp_path / "run" / "checkpoint" / f"hf-step-{STEPS}")
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["output_router_logits"] is True and config["router_aux_loss_coef"] == coef
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(hf).__name__ == transformers.AutoModelForCausalLM.from_config(hf.config).__class__.__name__
    router = FAMILIES[name][2]
    trained = dict(hf.named_parameters())[router]
    assert torch.equal(trained, _weight(out, router))  # transformers read the router we wrote ...
    assert not torch.equal(trained, _weight(folder, router))  # ... which the 3 steps trained


@pytest.mark.parametrize("where", ["command line", "toml"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_bias_balancing_with_an_hf_save_is_refused_before_any_step(name, where, folders, tmp_path, capsys):
    argv = _argv(name, folders[name], tmp_path / "run")
    if where == "toml":
        (tmp_path / "r.toml").write_text("[moe]\nload_balance_coeff = 0.001\n")
        argv = ["--job.config_file", str(tmp_path / "r.toml")] + argv
    else:
        argv += ["--moe.load_balance_coeff", "1e-3"]
    assert preflight.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --checkpoint.last_save hf_only writes a Hugging Face") and "\n" not in err, err
    assert "--moe.load_balance_coeff 0 and --moe.router_aux_loss_coef" in err, err
    assert not (tmp_path / "run").exists()  # nothing started


def test_interval_hf_saves_are_judged_too(folders, tmp_path, capsys):
    argv = _argv("qwen3_moe", folders["qwen3_moe"], tmp_path) + ["--checkpoint.last_save", "full",
                                                                  "--checkpoint.hf_interval", "2",
                                                                  "--moe.load_balance_coeff", "1e-3"]
    assert preflight.main(argv) == 1
    assert "error: --checkpoint.hf_interval 2 writes a Hugging Face" in capsys.readouterr().err


def test_bias_balancing_without_an_hf_save_runs_as_asked(folders):
    argv = _argv("qwen3_moe", folders["qwen3_moe"], "/tmp/unused") + ["--checkpoint.last_save", "full",
                                                                       "--moe.load_balance_coeff", "1e-3"]
    plan = plan_job(config_manager().parse_args(argv), 1)
    assert plan.model_args.moe.load_balance_coeff == 1e-3 and "as set" in plan.moe_balancing.why


def test_weights_only_from_hf_balance_as_the_format_does(folders):
    """--checkpoint.initial_load_in_hf alone (the shape from a flavor): the folder still decides."""
    folder = folders["qwen3_moe"]
    argv = COMMON + ["--model.name", "qwen3_moe", "--checkpoint.initial_load_path", folder,
                     "--checkpoint.initial_load_in_hf"]
    from torchtitan.components.moe.args import resolve_moe_balancing

    b = resolve_moe_balancing(config_manager().parse_args(argv), hf_keeps_expert_bias=False)
    assert (b.load_balance_coeff, b.router_aux_loss_coef) == (0.0, 0.001)


def test_pipeline_parallel_leaves_the_routers_exportable(folders):
    """transformers' loss needs the whole model in one stage: under PP the unset balancing is none at all."""
    argv = _argv("qwen3_moe", folders["qwen3_moe"], "/tmp/unused") + ["--parallelism.pipeline_parallel_degree", "2"]
    plan = plan_job(config_manager().parse_args(argv), 2)
    assert (plan.model_args.moe.load_balance_coeff, plan.model_args.moe.router_aux_loss_coef) == (0.0, 0.0)
    assert plan.moe_balancing.why.startswith("none:")


def test_deepseek_v3_keeps_its_bias_balancing_and_exports(tmp_path):
    """DeepSeek-V3's format stores the bias (e_score_correction_bias): the default bias balancing is kept and
    an HF save of it is not refused."""
    argv = COMMON + ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny", "--checkpoint.enable",
                     "--checkpoint.last_save", "hf_only", "--job.dump_folder", str(tmp_path)]
    assert preflight.main(argv) == 0
    assert plan_job(config_manager().parse_args(argv), 1).model_args.moe.load_balance_coeff == 1e-3


def test_every_adapter_declares_what_its_format_holds():
    """HF_KEEPS_EXPERT_BIAS (which the balancing and the pre-flight check read) agrees with what the adapter
    writes: a slot for `moe.expert_bias` or none. Generated from the registry: a new MoE family is covered."""
    checked = 0
    for spec in _registered().values():
        adapter = spec.state_dict_adapter
        moe_flavors = [a for a in spec.flavors.values() if getattr(a, "moe", None) is not None]
        if adapter is None or not moe_flavors:
            continue
        with torch.device("meta"):
            model = spec.model_cls(moe_flavors[0])
        biases = {k: t.shape for k, t in model.state_dict().items() if k.endswith("moe.expert_bias")}
        assert biases, spec.name
        layouts = {adapter(moe_flavors[0]).hf_layout(k, s) is not None for k, s in biases.items()}
        assert layouts == {adapter.HF_KEEPS_EXPERT_BIAS}, spec.name
        checked += 1
    assert checked >= 4
