"""The model's shape from a Hugging Face config.json (--model.hf_config) or field overrides, read strictly:
every key read or refused in one line; DeepSeek's YaRN read as transformers reads it; bad folders refused
with one line, a non-zero exit and nothing written."""

import json
import os
import sys

import pytest
import torch

from tests.tolerances import contraction_width, logits_tol
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder
from torchtitan.config import ConfigError, save_config
from torchtitan.job_plan import plan_job
from torchtitan.protocols.model_shape import resolve_model
from torchtitan.protocols.model_shape import pin_model_shape
from torchtitan.protocols.hf_config import UnsupportedHFConfig
from torchtitan.protocols.train_spec import config_manager

transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "checkpoints"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402
import generate  # noqa: E402

ROPE = {"rope_theta": 10000.0, "rope_type": "default"}
CONFIGS = {  # transformers config class, kwargs, our model name
    "llama": ("LlamaConfig", dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
                                  num_key_value_heads=1, tie_word_embeddings=True, vocab_size=2048), "llama3"),
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=24, vocab_size=2048, rope_parameters=ROPE), "qwen3"),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         vocab_size=2048, rope_parameters=ROPE), "qwen3_moe"),
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                                             num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                                             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                             topk_group=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
                                             qk_rope_head_dim=8, v_head_dim=8, vocab_size=2048, rope_parameters=ROPE),
                    "deepseek_v3"),
}


def _config_folder(tmp_path, family, **changes) -> str:
    cls, kwargs, _ = CONFIGS[family]
    folder = tmp_path / family
    getattr(transformers, cls)(**kwargs).save_pretrained(folder)
    if changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(changes)
        config = {k: v for k, v in config.items() if v is not ...}
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _resolve(*argv):
    return resolve_model(config_manager().parse_args(list(argv)))[2]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_every_family_takes_its_shape_from_the_folder_and_a_checkpoint_records_it(family, tmp_path):
    folder = _config_folder(tmp_path, family)
    name = CONFIGS[family][2]
    args = _resolve("--model.name", name, "--model.hf_config", folder)
    spec_adapter = resolve_model(config_manager().parse_args(["--model.name", name]))[0].state_dict_adapter
    spec_adapter.check_hf_config(folder, spec_adapter.args_from_hf(folder), args)  # the same model, every setting
    expected = {"llama": ("tie_embeddings", True), "qwen3": ("head_dim", 24), "qwen3_moe": ("n_kv_heads", 2),
                "deepseek_v3": ("q_lora_rank", 0)}[family]
    assert getattr(args, expected[0]) == expected[1]
    # What a checkpoint's config.toml holds rebuilds the same args without the folder.
    cfg = config_manager().parse_args(["--model.name", name, "--model.hf_config", folder])
    pin_model_shape(cfg, args)
    save_config(cfg, str(tmp_path / "config.toml"))
    os.rename(folder, folder + ".gone")
    assert _resolve("--job.config_file", str(tmp_path / "config.toml")) == args


def test_overrides_set_any_field_and_are_validated():
    args = _resolve("--model.overrides", "n_layers=3,rope_scaling.factor=2.0,tie_embeddings=true")
    assert (args.n_layers, args.rope_scaling.factor, args.tie_embeddings) == (3, 2.0, True)
    assert _resolve("--model.name", "deepseek_v3", "--model.overrides", "moe.top_k=1").moe.top_k == 1
    for bad, message in [("n_layer=3", "has no field 'n_layer'; try: n_layers"), ("n_layers=x", "'x' is not a valid int"),
                         ("n_layers", "write FIELD=VALUE")]:
        with pytest.raises(ConfigError, match=message):
            _resolve("--model.overrides", bad)


def test_unsupported_configs_are_refused_in_one_line(tmp_path):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(gpt2)
    with pytest.raises(ConfigError, match="architecture 'gpt2' is not supported; supported model_types: deepseek_v3"):
        _resolve("--model.hf_config", str(gpt2))
    with pytest.raises(ConfigError, match="is a 'qwen3' model: use --model.name qwen3"):
        _resolve("--model.hf_config", _config_folder(tmp_path, "qwen3"))
    cases = {
        "lacks 'num_hidden_layers', which Llama 3": dict(num_hidden_layers=...),
        "key 'sliding_window_pattern' is not understood by Llama 3": dict(sliding_window_pattern=4),
        "rope_type 'dynamic' is not supported": dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        "hidden_act 'gelu' is not supported": dict(hidden_act="gelu"),
    }
    for message, change in cases.items():
        folder = _config_folder(tmp_path / message[:8].replace(" ", "_"), "llama", **change)
        with pytest.raises(UnsupportedHFConfig) as e:
            _resolve("--model.hf_config", folder)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_folders_get_one_line_and_nothing_written(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(gpt2)
    llama = tmp_path / "llama"
    cls, kwargs, _ = CONFIGS["llama"]
    model = transformers.LlamaForCausalLM(getattr(transformers, cls)(**kwargs))
    model.save_pretrained(llama, max_shard_size="300KB")  # sharded, with an index
    files = sorted(f for f in os.listdir(llama) if f.endswith(".safetensors"))
    truncated = tmp_path / "truncated"
    os.makedirs(truncated)
    for f in os.listdir(llama):
        os.link(llama / f, truncated / f) if f != files[0] else None
    (truncated / files[0]).write_bytes((llama / files[0]).read_bytes()[:-1000])
    missing = tmp_path / "missing"
    os.makedirs(missing)
    for f in os.listdir(llama):
        if f != files[-1]:
            os.link(llama / f, missing / f)
    cases = {
        str(gpt2): "architecture 'gpt2' is not supported",
        str(truncated): f"{files[0]} is truncated: its header describes",
        str(missing): f"names {files[-1]}, which is missing from",
    }
    capsys.readouterr()  # transformers' own warnings while making the folders
    for folder, message in cases.items():
        out = tmp_path / "out"
        assert convert_from_hf.main([folder, str(out)]) == 1, folder
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not out.exists()
    # The pre-flight check (plan_job) finds a damaged initial_load_in_hf folder before any rank starts.
    for folder in (truncated, missing):
        cfg = config_manager().parse_args(["--model.hf_config", str(llama), "--checkpoint.initial_load_path",
                                           str(folder), "--checkpoint.initial_load_in_hf"])
        with pytest.raises(ValueError, match="is truncated|which is missing"):
            plan_job(cfg, 1)
    # the good folder generates and converts (its shape from config.json, no options), and the DCP
    # checkpoint it converts to records the shape
    assert generate.main([str(llama), "--prompt", "import os", "--max_new_tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("import os")
    assert convert_from_hf.main([str(llama), str(tmp_path / "dcp")]) == 0
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "keep.txt").write_text("x")
    assert convert_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "nonempty")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert os.listdir(tmp_path / "nonempty") == ["keep.txt"]
    assert convert_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "back"), "--dtype", "float32"]) == 0
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()
    for key, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key  # float32 through DCP and back: bit-exact


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707}  # no mscale_all_dim, as some derivatives write


def test_yarn_without_mscale_all_dim_reads_as_transformers(tmp_path):
    """transformers reads a missing mscale_all_dim as 0 (no softmax sharpening; rope attention factor from
    mscale 1); reading it as 1.0 gave logits 11% off. Positions run past the original 16."""
    from torchtitan.models.deepseek_v3.model import DeepSeekV3Model
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter as Adapter

    cls, kwargs, _ = CONFIGS["deepseek_v3"]
    config = getattr(transformers, cls)(**{**kwargs, "rope_parameters": YARN, "max_position_embeddings": 64})
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "mscale_all_dim" not in written["rope_parameters"]
    tokens = torch.randint(0, 2048, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(tokens).logits
    state, args = load_hf_folder(str(tmp_path / "hf"), Adapter)
    assert args.mscale_all_dim == 0.0
    ours = DeepSeekV3Model(args)
    ours.init_weights()
    ours.load_state_dict(state)
    with torch.no_grad():
        logits = ours.eval()(tokens).logits
    # Two float32 forward passes (MLA, MoE), weights of std 0.3: condition 4. Measured: uses 0.0051 of it (AVX-512),
    # 0.0048 (AVX2 caps).
    tol = logits_tol(expected, args.n_layers, contraction_width(ours, tokens.shape[1]), condition=4)
    torch.testing.assert_close(logits, expected, **tol)
    # and back: what we write, transformers reads as the same model
    save_hf_folder(ours.state_dict(), Adapter, args, str(tmp_path / "back"), dtype=torch.float32)
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, **tol)
