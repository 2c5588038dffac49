"""GPT-OSS equals transformers' GptOssForCausalLM on the same random weights, both directions (fp32, within
1e-5 of the logits' scale): ours -> save_hf_folder -> from_pretrained, and save_pretrained -> load_hf_folder ->
ours. The shape is the tests' own: both layer kinds (sliding, full, full, sliding), a window of 5 over 24
tokens, YaRN, GQA, a SwiGLU clamp that bites, and nonzero sinks and biases everywhere. Then the published
shapes, the sinks' and the window's negative controls, and an MXFP4 folder.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder  # noqa: E402
from torchtitan.models.gpt_oss.args import FULL, SLIDING, GptOssModelArgs, gpt_oss_moe  # noqa: E402
from torchtitan.models.gpt_oss.flavors import gpt_oss_flavors  # noqa: E402
from torchtitan.models.gpt_oss.model import GptOss  # noqa: E402
from torchtitan.models.gpt_oss.mxfp4 import Mxfp4Error, Mxfp4Reader  # noqa: E402
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter  # noqa: E402

MOE = gpt_oss_moe(num_experts=4, hidden_dim=32, top_k=2)
MOE.swiglu_limit = 0.6  # small enough that random activations hit the clamp on both sides
ARGS = GptOssModelArgs(
    dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=96, max_seq_len=64, sliding_window=5,
    layer_types=(SLIDING, FULL, FULL, SLIDING), rope_theta=150000.0, rope_factor=8.0, rope_original_seq_len=16,
    moe=MOE,
)
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _scale_close(got, want, rel=1e-5):
    err = float((got - want).abs().max())
    assert err <= rel * float(want.abs().max()), f"max error {err:.3g}, logits scale {float(want.abs().max()):.3g}"


def _randomise_(named_params, seed):
    """Every tensor random and nonzero (biases, sinks, router bias included); norms around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in named_params:
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * noise)
            elif "sinks" in name:
                p.copy_(noise)
            else:
                p.copy_(0.1 * noise)


def _ours(seed=0) -> GptOss:
    model = GptOss(ARGS)
    model.init_weights()
    _randomise_(model.named_parameters(), seed)
    return model.eval()


def test_ours_to_hf_logits(tmp_path):
    model = _ours()
    with torch.no_grad():
        ours = model(TOKENS).logits
    save_hf_folder(model.state_dict(), GptOssStateDictAdapter, ARGS, str(tmp_path), dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager")
    assert type(hf).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        _scale_close(ours, hf(TOKENS).logits)


def _hf_model(seed=1):
    config = transformers.GptOssConfig(**{
        k: v for k, v in GptOssStateDictAdapter.to_hf_config(ARGS, torch.float32).items()
        if k not in ("architectures", "model_type", "torch_dtype")
    })
    config._attn_implementation = "eager"
    hf = transformers.GptOssForCausalLM(config).eval()
    _randomise_(hf.named_parameters(), seed)
    return hf


def test_hf_to_ours_logits(tmp_path):
    hf = _hf_model()
    with torch.no_grad():
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    state, args = load_hf_folder(str(tmp_path), GptOssStateDictAdapter)
    assert args == ARGS
    model = GptOss(args)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        _scale_close(model.eval()(TOKENS).logits, expected)


@pytest.mark.parametrize("broken", ["sinks_dropped", "window_ignored"])
def test_the_comparison_sees_sinks_and_window(broken, tmp_path):
    hf = _hf_model()
    with torch.no_grad():
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    state, args = load_hf_folder(str(tmp_path), GptOssStateDictAdapter)
    model = GptOss(args)
    model.load_state_dict(state)
    for layer in model.layers.values():
        if broken == "sinks_dropped":
            layer.attention.sinks.forward = lambda: None
        else:
            layer.attention.inner_attention.window = None
    with torch.no_grad():
        with pytest.raises(AssertionError):
            _scale_close(model.eval()(TOKENS).logits, expected)


def test_moved_balancing_bias_refused_on_export():
    model = _ours()
    with torch.no_grad():
        model.layers["0"].moe.expert_bias[0] = 0.01
    with pytest.raises(ValueError, match="load_balance_coeff 0"):
        GptOssStateDictAdapter(ARGS).to_hf(model.state_dict())


@pytest.mark.parametrize("flavor,total,active", [("20b", 20.9e9, 3.6e9), ("120b", 116.8e9, 5.1e9)])
def test_published_shapes(flavor, total, active):
    args = gpt_oss_flavors[flavor]
    with torch.device("meta"):
        model = GptOss(args)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - total) / total < 0.01, n
    m = args.moe
    per_expert = sum(p[0].numel() for p in model.layers["0"].moe.experts.parameters())
    n_active = n - args.n_layers * (m.num_experts - m.top_k) * per_expert - args.vocab_size * args.dim  # output only
    assert abs(n_active - active) / active < 0.03, n_active


# ---- MXFP4 -----------------------------------------------------------------------------------------------


def _quantize_folder(folder, seed=2):
    """Replaces the experts' weights of an HF folder by random MXFP4 blocks/scales in the Hub layout (and marks
    the config quantized); returns transformers' own dequantization of each, keyed by the plain HF name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    expected = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        e, d_in, d_out = tensors.pop(key).shape
        blocks = torch.randint(0, 256, (e, d_out, d_in // 32, 16), generator=g, dtype=torch.int64).to(torch.uint8)
        scales = torch.randint(120, 130, (e, d_out, d_in // 32), generator=g, dtype=torch.int64).to(torch.uint8)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (folder / "config.json").write_text(json.dumps(config))
    return expected


def test_mxfp4_folder_loads_to_transformers_dequantized_values(tmp_path):
    _hf_model().save_pretrained(str(tmp_path))
    expected = _quantize_folder(tmp_path)
    state, _ = load_hf_folder(str(tmp_path), GptOssStateDictAdapter)
    for key, want in expected.items():
        layer, proj = key.split(".")[2], key.rsplit(".", 1)[1]
        ours = state[f"layers.{layer}.moe.experts.{'gate_up' if proj == 'gate_up_proj' else 'down'}"]
        assert want.shape == ours.shape and torch.equal(ours, want), key  # exactly


def test_mxfp4_reads_only_the_requested_experts(tmp_path):
    """A rank holding experts 2..3 of down_proj (EP 2) reads only their blocks and scales."""
    from torchtitan.components.checkpoint.hf_folder import SliceReader

    _hf_model().save_pretrained(str(tmp_path))
    expected = _quantize_folder(tmp_path)
    inner = SliceReader(str(tmp_path))
    calls = []
    real = inner.read

    def spy(key, offsets, sizes):
        calls.append((key, list(offsets), list(sizes)))
        return real(key, offsets, sizes)

    inner.read = spy
    reader = Mxfp4Reader(inner)
    key = "model.layers.1.mlp.experts.down_proj"
    shape = reader.shape(key)
    box = reader.read(key, [2, 0, 0], [2, *shape[1:]])
    assert torch.equal(box, expected[key][2:4])
    assert {c[0].rsplit("_", 1)[1] for c in calls} == {"blocks", "scales"}
    assert all(c[1][0] == 2 and c[2][0] == 2 for c in calls), calls


def test_mxfp4_scales_not_matching_blocks_is_one_line(tmp_path):
    _hf_model().save_pretrained(str(tmp_path))
    _quantize_folder(tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    key = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(Mxfp4Error, match="scales .* do not match blocks") as e:
        load_hf_folder(str(tmp_path), GptOssStateDictAdapter)
    assert "\n" not in str(e.value) and "gate_up_proj" in str(e.value)


# ---- bad input -------------------------------------------------------------------------------------------


def _plan(*extra, world=1):
    from torchtitan.job_plan import plan_job
    from torchtitan.protocols.train_spec import config_manager

    return plan_job(config_manager().parse_args(
        ["--model.name", "gpt_oss", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", *extra]), world)


def test_a_window_of_zero_is_one_line_before_anything_runs(tmp_path):
    from torchtitan.errors import USER_ERRORS

    with pytest.raises(USER_ERRORS) as e:
        _plan("--model.overrides", "sliding_window=0", "--job.dump_folder", str(tmp_path / "run"))
    assert "sliding window 0" in str(e.value) and ">= 1" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_sinks_on_a_kernel_that_cannot_take_them_is_one_line(monkeypatch):
    from torchtitan.distributed.context_parallel import ContextParallelAttention

    _plan("--parallelism.context_parallel_degree", "2", world=2)  # ring attention takes window and sinks
    monkeypatch.setattr(ContextParallelAttention, "KINDS", frozenset({"window"}))  # a kernel without sinks
    with pytest.raises(ValueError, match="ContextParallelAttention .context parallel. cannot compute sinks") as e:
        _plan("--parallelism.context_parallel_degree", "2", world=2)
    assert "\n" not in str(e.value)
