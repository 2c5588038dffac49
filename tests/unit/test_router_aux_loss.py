"""transformers' MoE load-balancing loss (Qwen3-MoE's `router_aux_loss_coef` with `output_router_logits`) is ours:
a random Qwen3MoeForCausalLM's save_pretrained folder loads with its coefficient, and on the same weights and
tokens our aux loss (per token) equals transformers' coef * load_balancing_loss_func value, and its gradient
on every router gate equals transformers' (fp32, tests/tolerances.logits_tol). transformers pools the top-k
picks and probabilities of all layers' tokens before the product (components/moe/moe.py RouterBalance): the mean
of per-layer values differs, and the test shows that it would notice."""

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from tests.tolerances import contraction_width, logits_tol  # noqa: E402
from torchtitan.components.checkpoint.hf_folder import load_hf_folder  # noqa: E402
from torchtitan.components.moe import MoEArgs  # noqa: E402
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs  # noqa: E402
from torchtitan.models.qwen3_moe.model import Qwen3Moe  # noqa: E402
from torchtitan.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter  # noqa: E402

COEF = 0.02
ARGS = Qwen3MoeModelArgs(
    dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=64, vocab_size=96, max_seq_len=64,
    rope_theta=1_000_000.0, moe=MoEArgs(num_experts=8, num_shared_experts=0, hidden_dim=16, top_k=2,
                                        score_func="softmax", route_norm=True, router_aux_loss_coef=COEF),
)
TOKENS = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_moe")
    config = {k: v for k, v in Qwen3MoeStateDictAdapter.to_hf_config(ARGS, torch.float32).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    assert config["output_router_logits"] is True and config["router_aux_loss_coef"] == COEF
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)  # routers far from uniform, so the loss is far from its minimum
    hf.save_pretrained(str(folder))
    state, args = load_hf_folder(str(folder), Qwen3MoeStateDictAdapter)
    assert args == ARGS  # the coefficient comes from the folder's config
    ours = Qwen3Moe(args)
    ours.load_state_dict(state, strict=True)
    return hf.train(), ours.train()


def _gates(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if name.endswith("gate.weight")]


def test_aux_loss_and_its_gradient_equal_transformers(hf_and_ours):
    hf, ours = hf_and_ours
    out = hf(TOKENS, output_router_logits=True)
    expected = COEF * out.aux_loss
    (hf_grads := torch.autograd.grad(expected, _gates(hf)))
    ours_out = ours(TOKENS)
    got = ours_out.aux_loss / TOKENS.numel()  # a sum over tokens; the trainer divides by the token count
    # The router logits come out of up to 3 blocks of two float32 forward passes, then a softmax and sums over
    # the 40 tokens: logits_tol of the whole model on the loss, and on each gate's gradient. Measured: uses 0.027 of it
    # (AVX-512), 0.026 (AVX2 caps).
    width = contraction_width(ours, TOKENS.shape[1])
    tol = logits_tol(expected, ARGS.n_layers, width)
    torch.testing.assert_close(got.detach(), expected.detach(), **tol)
    for g_ours, g_hf in zip(torch.autograd.grad(got, _gates(ours)), hf_grads):
        torch.testing.assert_close(g_ours, g_hf, **logits_tol(g_hf, ARGS.n_layers, width))
    # A per-layer loss (the mean of each layer's own value, from transformers' function on its own router
    # logits) is far outside the tolerance: the comparison above tells the two definitions apart.
    per_layer = sum(load_balancing_loss_func((g,), 8, 2) for g in out.router_logits) / len(out.router_logits)
    assert (COEF * per_layer - expected).abs() > 10 * tol["rtol"] * expected.abs()


def test_off_in_eval_and_at_zero(hf_and_ours):
    _, ours = hf_and_ours
    with torch.no_grad():
        assert ours.eval()(TOKENS).aux_loss is None
        ours.train()
        off = Qwen3Moe(dataclasses.replace(ARGS, moe=dataclasses.replace(ARGS.moe, router_aux_loss_coef=0.0)))
        off.load_state_dict(ours.state_dict())
        assert off.train()(TOKENS).aux_loss is None


def test_config_without_output_router_logits_reads_as_off():
    config = {**Qwen3MoeStateDictAdapter.to_hf_config(ARGS), "output_router_logits": False}
    assert Qwen3MoeStateDictAdapter.from_hf_config(config).moe.router_aux_loss_coef == 0.0


BAD = {
    "sigmoid routing": (1, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny",
                            "--moe.router_aux_loss_coef", "0.01"], "reads softmax router probabilities"),
    "pipeline parallel": (2, ["--model.name", "qwen3_moe", "--model.flavor", "debugmodel",
                              "--parallelism.pipeline_parallel_degree", "2", "--moe.router_aux_loss_coef", "0.01"],
                          "--moe.router_aux_loss_coef needs the whole model in one stage"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_refused_in_one_line_before_any_rank_starts(case, capsys):
    from torchtitan import preflight

    world, argv, says = BAD[case]
    assert preflight.main(["--world-size", str(world), "--training.seq_len", "32", "--training.local_batch_size",
                           "4"] + argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


# GPT-OSS defines the same loss (router_aux_loss_coef, output_router_logits) over its biased router's logits.
from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe  # noqa: E402
from torchtitan.models.gpt_oss.model import GptOss  # noqa: E402
from torchtitan.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter  # noqa: E402

GPT_OSS_ARGS = GptOssModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, vocab_size=96,
                               max_seq_len=64, sliding_window=8, moe=gpt_oss_moe(8, 16, 2))
GPT_OSS_ARGS.moe.router_aux_loss_coef = COEF


@pytest.fixture(scope="module")
def gpt_oss_hf_and_ours(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss")
    config = {k: v for k, v in GptOssStateDictAdapter.to_hf_config(GPT_OSS_ARGS, torch.float32).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    assert config["output_router_logits"] is True and config["router_aux_loss_coef"] == COEF
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("router.weight") or name.endswith("router.bias"):
                p.normal_(0, 0.5)  # routers far from uniform (and a nonzero bias), so the loss is informative
    hf.save_pretrained(str(folder))
    state, args = load_hf_folder(str(folder), GptOssStateDictAdapter)
    assert args.moe.router_aux_loss_coef == COEF  # the coefficient comes from the folder's config
    ours = GptOss(args)
    ours.load_state_dict(state, strict=False)  # the balancing bias buffer is ours alone (zeros)
    return hf.train(), ours.train()


def test_gpt_oss_aux_loss_and_its_gradient_equal_transformers(gpt_oss_hf_and_ours):
    hf, ours = gpt_oss_hf_and_ours
    out = hf(TOKENS, output_router_logits=True)
    expected = GptOssStateDictAdapter.to_hf_config(GPT_OSS_ARGS)["router_aux_loss_coef"] * out.aux_loss
    hf_gates = [p for n, p in hf.named_parameters() if n.endswith("router.weight")]
    hf_grads = torch.autograd.grad(expected, hf_gates)
    got = ours(TOKENS).aux_loss / TOKENS.numel()
    # as above, 2 blocks. Measured: uses 0.042 of it (AVX-512), 0.038 (AVX2 caps).
    width = contraction_width(ours, TOKENS.shape[1])
    torch.testing.assert_close(got.detach(), expected.detach(), **logits_tol(expected, GPT_OSS_ARGS.n_layers, width))
    assert len(hf_gates) == len(_gates(ours)) == GPT_OSS_ARGS.n_layers
    for g_ours, g_hf in zip(torch.autograd.grad(got, _gates(ours)), hf_grads):
        torch.testing.assert_close(g_ours, g_hf, **logits_tol(g_hf, GPT_OSS_ARGS.n_layers, width))
    config = {**GptOssStateDictAdapter.to_hf_config(GPT_OSS_ARGS), "output_router_logits": False}
    assert GptOssStateDictAdapter.from_hf_config(config).moe.router_aux_loss_coef == 0.0


# Qwen3.5-MoE trains its routers with the same loss (Qwen3_5MoeForCausalLM, output_router_logits); our Qwen3.5
# forward adds it over every MoE layer's tokens together, as Qwen3-MoE's does.
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs, interval_layer_types  # noqa: E402
from torchtitan.models.qwen3_5.model import Qwen3_5  # noqa: E402
from torchtitan.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter  # noqa: E402

QWEN3_5_ARGS = Qwen3_5ModelArgs(
    dim=32, n_layers=3, vocab_size=96, max_seq_len=64, hidden_dim=16, layer_types=interval_layer_types(3, 3),
    n_heads=4, n_kv_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_chunk_size=8,
    moe=MoEArgs(num_experts=8, num_shared_experts=1, hidden_dim=16, top_k=2, score_func="softmax", route_norm=True,
                shared_hidden_dim=24, shared_gate=True, router_aux_loss_coef=COEF))


def test_qwen3_5_aux_loss_and_its_gradient_equal_transformers(tmp_path):
    config = {k: v for k, v in Qwen3_5StateDictAdapter.to_hf_config(QWEN3_5_ARGS, torch.float32).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    assert config["output_router_logits"] is True and config["router_aux_loss_coef"] == COEF
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**config)).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routers far from uniform, so the loss is far from its minimum
    hf.save_pretrained(str(tmp_path))
    state, args = load_hf_folder(str(tmp_path), Qwen3_5StateDictAdapter)
    assert args.moe.router_aux_loss_coef == COEF  # the coefficient comes from the folder's config
    ours = Qwen3_5(args)
    ours.load_state_dict(state, strict=True)
    hf.train(), ours.train()
    expected = COEF * hf(TOKENS, output_router_logits=True).aux_loss
    hf_gates = [p for n, p in hf.named_parameters() if n.endswith("mlp.gate.weight")]
    hf_grads = torch.autograd.grad(expected, hf_gates)
    got = ours(TOKENS).aux_loss / TOKENS.numel()
    torch.testing.assert_close(got.detach(), expected.detach(), rtol=1e-6, atol=1e-7)
    ours_gates = [p for n, p in ours.named_parameters() if n.endswith("router.gate.weight")]
    assert len(hf_gates) == len(ours_gates) == QWEN3_5_ARGS.n_layers
    for g_ours, g_hf in zip(torch.autograd.grad(got, ours_gates), hf_grads):
        torch.testing.assert_close(g_ours, g_hf, rtol=1e-5, atol=1e-7)
