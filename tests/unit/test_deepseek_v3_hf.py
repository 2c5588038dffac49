"""DeepSeek-V3 equals Hugging Face's DeepseekV3ForCausalLM on the same random weights, both directions.

Ours -> HF: our model's weights written as an HF folder (save_hf_folder) and loaded by transformers. HF -> ours:
a transformers model's save_pretrained folder read by load_hf. Logits must agree within 1e-5 (fp32) on
positions past the original context, so YaRN's frequency ramp and attention temperature are exercised,
with compressed and direct queries, group-limited sigmoid routing, a non-zero balancing bias and a dense
first layer. transformers is a test-only reference (the `test` extra).
"""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs  # noqa: E402
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model  # noqa: E402
from torchtitan.models.deepseek_v3.state_dict_adapter import FP8_MESSAGE, DeepSeekV3StateDictAdapter  # noqa: E402
from tests.tolerances import contraction_width, logits_tol  # noqa: E402
from torchtitan.components.moe import MoEArgs  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder  # noqa: E402

ARGS = DeepSeekV3ModelArgs(
    vocab_size=96, dim=32, inter_dim=48, n_layers=3, n_dense_layers=1, n_heads=4,
    moe=MoEArgs(num_experts=8, num_shared_experts=1, hidden_dim=16, top_k=3, score_func="sigmoid",
                route_norm=True, route_scale=2.5, n_groups=4, topk_groups=2),
    q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
    max_seq_len=128, rope_theta=10000.0, rope_factor=4.0, original_seq_len=16, mscale=1.0, mscale_all_dim=1.0,
)
VARIANTS = {"compressed_q": ARGS, "direct_q": dataclasses.replace(ARGS, q_lora_rank=0)}
TOKENS = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(0))


def _hf_logits(folder) -> torch.Tensor:
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(TOKENS).logits


def _our_model(args) -> DeepSeekV3Model:
    model = DeepSeekV3Model(args)
    model.init_weights()
    return model.eval()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ours_to_hf_logits(variant, tmp_path):
    torch.manual_seed(0)
    model = _our_model(VARIANTS[variant])
    with torch.no_grad():
        for block in list(model.layers.values())[1:]:
            block.moe.expert_bias.copy_(torch.randn(8) * 0.1)
        ours = model(TOKENS).logits
    save_hf_folder(model.state_dict(), DeepSeekV3StateDictAdapter, VARIANTS[variant], str(tmp_path), dtype=torch.float32)
    # Two float32 forward passes of 3 blocks (MLA, sigmoid-routed MoE). Measured: uses 0.0025 of it (AVX-512), 0.0025
    # (AVX2 caps).
    torch.testing.assert_close(_hf_logits(str(tmp_path)), ours,
                               **logits_tol(ours, ARGS.n_layers, contraction_width(model, TOKENS.shape[1])))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_to_ours_logits(variant, tmp_path):
    torch.manual_seed(1)
    config = transformers.DeepseekV3Config(**{
        k: v for k, v in DeepSeekV3StateDictAdapter.to_hf_config(VARIANTS[variant], torch.float32).items()
        if k not in ("architectures", "model_type", "torch_dtype")
    })
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.1)
        for name, p in hf.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # HF initialises norms to ones: make them count
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    state, args = load_hf_folder(str(tmp_path), DeepSeekV3StateDictAdapter)
    assert args == VARIANTS[variant]
    model = _our_model(args)
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        # As above, the other way. Measured: uses 0.0073 of it (AVX-512), 0.0084 (AVX2 caps).
        torch.testing.assert_close(model(TOKENS).logits, expected,
                                   **logits_tol(expected, ARGS.n_layers, contraction_width(model, TOKENS.shape[1])))


def test_fp8_checkpoint_refused_in_one_line():
    with pytest.raises(ValueError, match="fp8 block-quantised"):
        DeepSeekV3StateDictAdapter.from_hf_config({**DeepSeekV3StateDictAdapter.to_hf_config(ARGS),
                                                   "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="dequantise"):
        DeepSeekV3StateDictAdapter(ARGS).from_hf({"model.layers.0.mlp.gate_proj.weight_scale_inv": torch.ones(1)})
    assert "\n" not in FP8_MESSAGE


def _write_hf_folder_with_mtp(folder: str, args: DeepSeekV3ModelArgs) -> None:
    """A random transformers DeepseekV3 folder (num_nextn_predict_layers = args.mtp_depth) plus, as the
    published checkpoints carry it, the MTP layer(s) numbered after the main ones: a decoder layer's weights
    (taken from a deeper random transformers model), enorm, hnorm, eh_proj, shared_head.norm, and copies of
    the embedding and output head."""
    import shutil

    from safetensors.torch import load_file, save_file

    config = {k: v for k, v in DeepSeekV3StateDictAdapter.to_hf_config(args, torch.float32).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(2)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    hf.save_pretrained(folder)
    deeper = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**config, "num_hidden_layers": args.n_layers + args.mtp_depth}))
    deeper.save_pretrained(f"{folder}/deeper")  # the per-expert names of a published checkpoint
    deeper_tensors = load_file(f"{folder}/deeper/model.safetensors")
    shutil.rmtree(f"{folder}/deeper")
    tensors = load_file(f"{folder}/model.safetensors")
    for i in range(args.n_layers, args.n_layers + args.mtp_depth):
        prefix = f"model.layers.{i}."
        tensors.update({k: v for k, v in deeper_tensors.items() if k.startswith(prefix)})
        tensors[prefix + "mlp.gate.e_score_correction_bias"] = torch.randn(args.moe.num_experts) * 0.1
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            tensors[prefix + name] = 1 + 0.1 * torch.randn(args.dim)
        tensors[prefix + "eh_proj.weight"] = torch.randn(args.dim, 2 * args.dim) * 0.02
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[prefix + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, f"{folder}/model.safetensors", metadata={"format": "pt"})


def test_mtp_layer_loads_and_saves_back_bit_exact(tmp_path):
    """A DeepSeek-V3 folder with an MTP layer: every tensor reaches our model (one process, and each rank's
    slices through load_hf_into as the checkpoint manager reads them), and writing ours gives the same
    tensors back, bit for bit, under the same names."""
    from safetensors.torch import load_file

    from torchtitan.components.checkpoint.hf_folder import load_hf_into

    args = dataclasses.replace(ARGS, mtp_depth=1)
    src, out = tmp_path / "src", tmp_path / "out"
    _write_hf_folder_with_mtp(str(src), args)
    state, loaded_args = load_hf_folder(str(src), DeepSeekV3StateDictAdapter)
    assert loaded_args == args  # num_nextn_predict_layers -> mtp_depth
    model = DeepSeekV3Model(args)
    model.load_state_dict(state, strict=True)
    sliced = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_hf_into(sliced, str(src), DeepSeekV3StateDictAdapter(args))
    for key, t in model.state_dict().items():
        assert torch.equal(sliced[key], t), key
    save_hf_folder(model.state_dict(), DeepSeekV3StateDictAdapter, args, str(out), dtype=torch.float32)
    theirs, ours = load_file(f"{src}/model.safetensors"), load_file(f"{out}/model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert any(k.startswith(f"model.layers.{args.n_layers}.") for k in ours)
    for key, t in theirs.items():
        assert torch.equal(ours[key], t), key
    import json

    assert json.load(open(out / "config.json"))["num_nextn_predict_layers"] == 1
    # a job without MTP (mtp_depth 0) accepts the folder and reads its main model, skipping the MTP layer
    DeepSeekV3StateDictAdapter.check_hf_config(str(src), loaded_args, ARGS)
    main_only = {k: torch.zeros_like(v) for k, v in DeepSeekV3Model(ARGS).state_dict().items()}
    load_hf_into(main_only, str(src), DeepSeekV3StateDictAdapter(ARGS))
    for key, t in main_only.items():
        assert torch.equal(state[key], t), key
