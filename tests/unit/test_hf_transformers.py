"""Hugging Face folders as transformers itself writes them, in both config layouts, against transformers'
own LlamaForCausalLM: transformers 5.x writes `rope_parameters`, 4.x wrote top-level `rope_theta` /
`rope_scaling` (the 4.x folder here is the 5.x one with its config rewritten the way 4.x wrote it, since one
environment holds one transformers). The same random weights must give the same logits within 1e-5 (of the
logits' scale: the two implementations sum in different orders in float32)."""

import json
import os

import pytest
import torch

from tests.tolerances import contraction_width, logits_tol
from torchtitan.components.checkpoint.manager import CheckpointError
from torchtitan.components.checkpoint.offline_model import load_model_weights
from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.model import Transformer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.state_dict_adapter import HFConfigMismatch
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder  # noqa: E402

transformers = pytest.importorskip("transformers")

SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
ARGS = TransformerModelArgs(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_hidden_dim=160, norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling=RopeScalingArgs(**{k: v for k, v in SCALING.items() if k != "rope_type"}),
    max_seq_len=64,
)
TOKENS = torch.randint(0, ARGS.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))  # past 32


def _as_4x(config: dict) -> dict:
    """A 5.x config.json rewritten the way transformers 4.x wrote it."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope["rope_type"] == "default" else rope
    config["torch_dtype"] = config.pop("dtype", None) or "float32"
    return config


@pytest.fixture(scope="module")
def hf_model_and_folders(tmp_path_factory):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=97, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 500000.0, **SCALING},
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # far from the default init, so attention is sharp and RoPE errors show
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    v5 = tmp_path_factory.mktemp("hf5")
    model.save_pretrained(v5)
    written = json.loads((v5 / "config.json").read_text())
    assert "rope_parameters" in written and "rope_theta" not in written  # really the 5.x layout
    v4 = tmp_path_factory.mktemp("hf4")
    (v4 / "config.json").write_text(json.dumps(_as_4x(written)))
    os.link(v5 / "model.safetensors", v4 / "model.safetensors")
    return model, {"4.x": str(v4), "5.x": str(v5)}


def _ours(state_dict) -> Transformer:
    model = Transformer(ARGS)
    model.init_weights(buffer_device=None)
    model.load_state_dict(state_dict)
    return model.eval()


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_both_config_layouts_load_into_the_same_model_as_transformers(hf_model_and_folders, layout):
    hf_model, folders = hf_model_and_folders
    state_dict, args = load_hf_folder(folders[layout], Llama3StateDictAdapter, expected=ARGS)
    assert args.rope_theta == 500000.0 and args.rope_scaling == ARGS.rope_scaling
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        # transformers reading the same folder agrees with itself in either layout: same code, same weights,
        # same kernels, so bitwise (a rope setting read differently would move every logit)
        reread = transformers.LlamaForCausalLM.from_pretrained(folders[layout]).eval()
        assert torch.equal(reread(TOKENS).logits, expected)
        # Two float32 forward passes of 2 blocks (longest contraction: the FFN's 160). Measured: uses 0.055 of it
        # (AVX-512), 0.057 (AVX2 caps).
        ours = _ours(state_dict)
        torch.testing.assert_close(ours(TOKENS), expected,
                                   **logits_tol(expected, ARGS.n_layers, contraction_width(ours, TOKENS.shape[1])))


def test_what_we_write_transformers_reads_as_the_same_model(hf_model_and_folders, tmp_path):
    hf_model, folders = hf_model_and_folders
    state_dict, _ = load_hf_folder(folders["5.x"], Llama3StateDictAdapter, expected=ARGS)
    save_hf_folder(state_dict, Llama3StateDictAdapter, ARGS, str(tmp_path), dtype=torch.float32)
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert back.config.rope_parameters["rope_theta"] == 500000.0
    with torch.no_grad():
        assert torch.equal(back(TOKENS).logits, hf_model(TOKENS).logits)  # same code and weights: bitwise


@pytest.mark.parametrize("layout", ["4.x", "5.x"])
def test_a_mismatched_rope_theta_is_refused_in_one_line(hf_model_and_folders, layout):
    _, folders = hf_model_and_folders
    flavor = TransformerModelArgs(**{**ARGS.__dict__, "rope_theta": 10000.0})
    with pytest.raises(HFConfigMismatch) as e:
        load_hf_folder(folders[layout], Llama3StateDictAdapter, expected=flavor)
    assert str(e.value) == (
        f"Hugging Face config {folders[layout]}/config.json does not match the model: rope_theta 500000.0 in the "
        f"folder vs 10000.0 in the model; train the folder's own shape (--model.hf_config {folders[layout]}) or "
        f"pick the --model.flavor (and tokenizer) the folder was made for"
    )
    # Generation and conversion report it as a checkpoint error, same line.
    with pytest.raises(CheckpointError, match="rope_theta 500000.0 in the folder vs 10000.0 in the model"):
        load_model_weights(Transformer(flavor), folders[layout], Llama3StateDictAdapter, flavor)


def test_every_setting_is_compared(hf_model_and_folders):
    _, folders = hf_model_and_folders
    other = TransformerModelArgs(**{**ARGS.__dict__, "norm_eps": 1e-6, "rope_scaling": None, "n_kv_heads": 4})
    with pytest.raises(HFConfigMismatch) as e:
        load_hf_folder(folders["5.x"], Llama3StateDictAdapter, expected=other)
    message = str(e.value)
    assert "\n" not in message
    assert "num_key_value_heads 2 in the folder vs 4 in the model" in message
    assert "rms_norm_eps 1e-05 in the folder vs 1e-06 in the model" in message
    # RoPE scaling settings are named one by one (transformers 5.x nests them in rope_parameters)
    assert "rope_type llama3 in the folder vs default in the model" in message
    assert "factor 4.0 in the folder vs None in the model" in message


def test_a_head_dim_other_than_hidden_over_heads_matches_transformers_both_ways(tmp_path):
    """transformers' LlamaConfig lets head_dim differ from hidden_size / heads (here 4 heads of 24 on a width
    of 64: the attention is 96 wide). HF -> ours: the folder's logits; ours -> HF: a model of ours with its
    own random init, written and read back by transformers. 1e-5 of the logits' scale both ways."""
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, vocab_size=97, rms_norm_eps=1e-5, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    hf_model.save_pretrained(tmp_path / "in")
    state_dict, args = load_hf_folder(str(tmp_path / "in"), Llama3StateDictAdapter)
    assert (args.head_dim, args.dim, args.n_heads) == (24, 64, 4)
    model = Transformer(args)
    model.init_weights(buffer_device=None)
    model.load_state_dict(state_dict)
    with torch.no_grad():
        expected = hf_model(TOKENS).logits
        # Two float32 forward passes of 2 blocks, weights of std 0.3 (sharp attention: condition 4). Measured: uses
        # 0.051 of it (AVX-512), 0.045 (AVX2 caps).
        tol = logits_tol(expected, args.n_layers, contraction_width(model, TOKENS.shape[1]), condition=4)
        torch.testing.assert_close(model.eval()(TOKENS), expected, **tol, msg="HF -> ours")

    torch.manual_seed(1)
    ours = Transformer(args)
    ours.init_weights(buffer_device=None)
    with torch.no_grad():  # weights transformers never saw, as sharp as the folder's
        for name, p in ours.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.3)
    save_hf_folder(ours.state_dict(), Llama3StateDictAdapter, args, str(tmp_path / "out"), dtype=torch.float32)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert back.config.head_dim == 24
    with torch.no_grad():
        mine = ours.eval()(TOKENS)
        tol = logits_tol(mine, args.n_layers, contraction_width(ours, TOKENS.shape[1]), condition=4)  # as above
        torch.testing.assert_close(back(TOKENS).logits, mine, **tol, msg="ours -> HF")
