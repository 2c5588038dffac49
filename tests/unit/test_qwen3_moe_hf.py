"""Qwen3-MoE equals Hugging Face's Qwen3MoeForCausalLM on the same random weights, both directions (fp32,
1e-5): ours -> save_hf_folder -> transformers, and transformers' save_pretrained -> load_hf_folder -> ours. Also: a
moved balancing bias, which HF's router cannot hold, is refused on export."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.tolerances import contraction_width, logits_tol  # noqa: E402
from torchtitan.components.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs  # noqa: E402
from torchtitan.models.qwen3_moe.model import Qwen3Moe  # noqa: E402
from torchtitan.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import load_hf_folder, save_hf_folder  # noqa: E402

ARGS = Qwen3MoeModelArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=96, max_seq_len=64,
    rope_theta=1_000_000.0, moe=MoEArgs(num_experts=8, num_shared_experts=0, hidden_dim=16, top_k=3,
                                        score_func="softmax", route_norm=True),
)
TOKENS = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(0))


def _ours() -> Qwen3Moe:
    model = Qwen3Moe(ARGS)
    model.init_weights()
    return model.eval()


def test_ours_to_hf_logits(tmp_path):
    torch.manual_seed(0)
    model = _ours()
    with torch.no_grad():
        ours = model(TOKENS).logits
    save_hf_folder(model.state_dict(), Qwen3MoeStateDictAdapter, ARGS, str(tmp_path), dtype=torch.float32)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        # Two float32 forward passes of 2 MoE blocks (the routing picks the same experts: no near-ties). Measured: uses
        # 0.0051 of it (AVX-512), 0.0051 (AVX2 caps).
        tol = logits_tol(ours, ARGS.n_layers, contraction_width(model, 24))
        torch.testing.assert_close(hf(TOKENS).logits, ours, **tol)


def test_hf_to_ours_logits(tmp_path):
    torch.manual_seed(1)
    config = transformers.Qwen3MoeConfig(**{
        k: v for k, v in Qwen3MoeStateDictAdapter.to_hf_config(ARGS, torch.float32).items()
        if k not in ("architectures", "model_type", "torch_dtype")
    })
    hf = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # HF initialises norms to ones: make them count
        expected = hf(TOKENS).logits
    hf.save_pretrained(str(tmp_path))
    state, args = load_hf_folder(str(tmp_path), Qwen3MoeStateDictAdapter)
    assert args == ARGS
    model = _ours()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        # As above, the other way. Measured: uses 0.01 of it (AVX-512), 0.01 (AVX2 caps).
        torch.testing.assert_close(model(TOKENS).logits, expected,
                                   **logits_tol(expected, ARGS.n_layers, contraction_width(model, 24)))


def test_moved_bias_refused_on_export():
    model = _ours()
    with torch.no_grad():
        model.layers["0"].moe.expert_bias[0] = 0.01
    with pytest.raises(ValueError, match="load_balance_coeff 0"):
        Qwen3MoeStateDictAdapter(ARGS).to_hf(model.state_dict())
