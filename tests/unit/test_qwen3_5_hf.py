"""Qwen3.5 equals transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (their torch path: no fla or
causal_conv1d kernels installed) on the same random weights, both directions, fp32, within 1e-5 of the logits'
scale: ours -> save_hf_folder (the sliced writer) -> transformers, and transformers' save_pretrained -> our
loaders (whole-folder and per-slice) -> ours. Shapes no flavor has: k heads != v heads, key/value/softmax head
dims all different, partial RoPE 0.5, conv kernel 3, a full-attention layer every 3rd. Plus: a multimodal
folder loads its language model and names what it left out; bad configs are refused in one line."""

import dataclasses
import importlib.util
import json
import logging
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan.components.checkpoint.hf_folder import load_hf_folder, load_hf_into, save_hf_folder  # noqa: E402
from tests.tolerances import logits_tol  # noqa: E402
from torchtitan.components.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs, interval_layer_types  # noqa: E402
from torchtitan.models.qwen3_5.model import Qwen3_5  # noqa: E402
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter  # noqa: E402
from torchtitan.protocols.hf_config import UnsupportedHFConfig  # noqa: E402

DENSE = Qwen3_5ModelArgs(
    dim=48, n_layers=5, vocab_size=96, max_seq_len=64, hidden_dim=80, layer_types=interval_layer_types(5, 3),
    n_heads=4, n_kv_heads=2, head_dim=16, rope_theta=100_000.0, partial_rotary_factor=0.5,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=12,
    linear_conv_kernel_dim=3, linear_chunk_size=8,
)
MOE = dataclasses.replace(DENSE, n_layers=4, hidden_dim=16, layer_types=interval_layer_types(4, 3), moe=MoEArgs(
    num_experts=6, num_shared_experts=1, hidden_dim=16, top_k=2, score_func="softmax", route_norm=True,
    shared_hidden_dim=24, shared_gate=True))
TOKENS = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(0))


def test_no_fused_kernels_installed():
    # transformers would take them instead of its torch path, and the comparison would not be the torch path.
    assert importlib.util.find_spec("fla") is None and importlib.util.find_spec("causal_conv1d") is None


def _close(got, expected):
    # Two float32 forward passes of up to 5 blocks (DeltaNet's chunked recurrence or attention, then the FFN);
    # the longest contraction is the FFN's 80 (DeltaNet chunks of 8). Measured: uses 0.0069 of it (AVX-512), 0.0073
    # (AVX2 caps).
    torch.testing.assert_close(got, expected, **logits_tol(expected, DENSE.n_layers, DENSE.hidden_dim))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def _randomise_(named_params):
    """Norm weights and DeltaNet per-head parameters start at constants: make every one count."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in named_params:
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=gen))


def _ours(args, seed):
    torch.manual_seed(seed)
    model = Qwen3_5(args)
    model.init_weights()
    _randomise_(model.named_parameters())
    return model.eval()


def _hf_class(args):
    return transformers.Qwen3_5MoeForCausalLM if args.moe else transformers.Qwen3_5ForCausalLM


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_ours_to_hf_logits(args, tmp_path):
    model = _ours(args, 0)
    with torch.no_grad():
        ours = _logits(model(TOKENS))
    save_hf_folder(model.state_dict(), Qwen3_5StateDictAdapter, args, str(tmp_path), dtype=torch.float32)
    hf = _hf_class(args).from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        _close(hf(TOKENS).logits, ours)


def _hf_model(args, seed):
    config_cls = transformers.Qwen3_5MoeTextConfig if args.moe else transformers.Qwen3_5TextConfig
    config = config_cls(**{k: v for k, v in Qwen3_5StateDictAdapter.to_hf_config(args, torch.float32).items()
                           if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(seed)
    hf = _hf_class(args)(config).eval()
    _randomise_(hf.named_parameters())
    return hf


@pytest.mark.parametrize("args", [DENSE, MOE], ids=["dense", "moe"])
def test_hf_to_ours_logits(args, tmp_path):
    hf = _hf_model(args, 1)
    with torch.no_grad():
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    # Whole-folder conversion (scripts/checkpoints/convert_from_hf.py's path).
    state, read_args = load_hf_folder(str(tmp_path), Qwen3_5StateDictAdapter, expected=args)
    assert dataclasses.replace(read_args, linear_chunk_size=args.linear_chunk_size) == args  # a setting, not in HF
    model = _ours(args, 2)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        _close(_logits(model(TOKENS)), expected)
    # Per-slice loading (each rank reads its boxes; here one rank, whole tensors).
    model = _ours(args, 3)
    sd = model.state_dict()
    load_hf_into(sd, str(tmp_path), Qwen3_5StateDictAdapter(args))
    with torch.no_grad():
        _close(_logits(model(TOKENS)), expected)


def test_multimodal_folder_loads_its_language_model(tmp_path, caplog):
    text = {k: v for k, v in Qwen3_5StateDictAdapter.to_hf_config(DENSE, torch.float32).items()
            if k not in ("architectures", "model_type", "torch_dtype")}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=DENSE.dim,
                  patch_size=4, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    config = transformers.Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(4)
    hf = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    _randomise_(hf.named_parameters())
    with torch.no_grad():
        expected = hf(input_ids=TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    with caplog.at_level(logging.INFO):
        state, args = load_hf_folder(str(tmp_path), Qwen3_5StateDictAdapter)
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(lines) == 1 and "vision tower" in lines[0], lines
    assert args.hf_weight_prefix == "model.language_model."
    model = Qwen3_5(args)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        _close(model.eval()(TOKENS), expected)


def _config_file(tmp_path, **changes):
    config = {**Qwen3_5StateDictAdapter.to_hf_config(DENSE, torch.float32), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("changes, phrase", [
    ({"layer_types": ["linear_attention", "sliding_attention", "full_attention", "linear_attention",
                      "full_attention"]}, "layer type 'sliding_attention'"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim 0"),
    ({"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
    ({"some_new_setting": 1}, "'some_new_setting' is not understood"),
])
def test_bad_configs_refused_in_one_line(tmp_path, changes, phrase):
    with pytest.raises(UnsupportedHFConfig) as e:
        Qwen3_5StateDictAdapter.args_from_hf(_config_file(tmp_path, **changes))
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_unknown_weight_refused(tmp_path):
    model = _ours(DENSE, 0)
    hf = Qwen3_5StateDictAdapter(DENSE).to_hf(model.state_dict())
    hf["model.layers.0.linear_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="unsupported Hugging Face weight"):
        Qwen3_5StateDictAdapter(DENSE).from_hf(hf)
