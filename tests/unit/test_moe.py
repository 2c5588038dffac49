"""The MoE layer computes what its definition says, whichever kernel runs the experts.

The reference is written token by token in plain Python (score every expert, keep the best groups, take the
top-k, weight, sum the experts' SwiGLUs, add the shared experts), so the sorting, dispatch, grouped matmuls
and scatter-add of the layer are checked against the definition, not against themselves. fp32, tolerance
1e-5 (the two only reorder sums).
"""

import pytest
import torch
import torch.nn.functional as F

from tests.tolerances import BF16_U, chain_tol
from torchtitan.components.moe import MoE, MoEArgs
from torchtitan.components.moe.experts import expert_swiglu

DIM = 16


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, hidden_dim=24, top_k=2, **kw)
    moe = MoE(DIM, args)
    moe.init_weights(out_std=0.1)
    with torch.no_grad():
        moe.expert_bias.copy_(torch.randn(8) * 0.05)
    return moe


def _swiglu(x, w1, w2, w3):
    return w2 @ (F.silu(w1 @ x) * (w3 @ x))


def _reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    a, ex = moe.args, moe.experts
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            t = x[b, s]
            logits = moe.router.gate.weight @ t
            scores = logits.sigmoid() if a.score_func == "sigmoid" else logits.softmax(-1)
            choice = scores + moe.expert_bias
            per_group = a.num_experts // a.n_groups
            strength = []
            for g in range(a.n_groups):
                members = sorted(choice[g * per_group : (g + 1) * per_group].tolist(), reverse=True)
                strength.append(sum(members[:2]) if a.score_func == "sigmoid" else members[0])
            groups = sorted(range(a.n_groups), key=lambda g: -strength[g])[: a.topk_groups]
            allowed = [e for e in range(a.num_experts) if e // per_group in groups]
            chosen = sorted(allowed, key=lambda e: -choice[e].item())[: a.top_k]
            w = scores[chosen]
            if a.route_norm:
                w = w / w.sum()
            w = w * a.route_scale
            y = sum(w[k] * _swiglu(t, ex.w1[e], ex.w2[e], ex.w3[e]) for k, e in enumerate(chosen))
            if moe.shared_experts is not None:
                sh = moe.shared_experts
                y = y + _swiglu(t, sh.w1.weight, sh.w2.weight, sh.w3.weight)
            out[b, s] = y
    return out


ROUTINGS = {
    "sigmoid_groups_norm_scale": dict(score_func="sigmoid", n_groups=4, topk_groups=2, route_scale=2.5),
    "softmax_no_norm_no_shared": dict(score_func="softmax", route_norm=False, num_shared_experts=0),
    "softmax_groups_two_shared": dict(score_func="softmax", n_groups=2, topk_groups=1, num_shared_experts=2),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_moe_matches_per_token_reference(routing):
    moe = _moe(**ROUTINGS[routing])
    x = torch.randn(2, 5, DIM)
    with torch.no_grad():
        got = moe(x)
        ref = _reference(moe, x)
    # float32, a chain of 4 contractions of at most 24 terms: the router's, an expert's two projections, the
    # weighted sum of the chosen and shared experts. Measured: uses 0.055 of it (AVX-512), 0.052 (AVX2 caps).
    torch.testing.assert_close(got.out, ref, **chain_tol(ref.abs().max().item(), 4, 24))
    assert got.load.sum() == 2 * 5 * 2 and got.aux_loss is None


def _expert_inputs(dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 0, 3, 9], device=device)  # an empty expert on purpose
    x = torch.randn(int(counts.sum()), 16, generator=gen).to(device, dtype)
    w1, w3 = (torch.randn(4, 24, 16, generator=gen).to(device, dtype) * 0.2 for _ in range(2))
    w2 = torch.randn(4, 16, 24, generator=gen).to(device, dtype) * 0.2
    return x, w1, w2, w3, counts


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
def test_grouped_gemm_forward_equals_loop_on_cpu():
    """torch's CPU reference kernel of _grouped_mm checks the grouped path's offsets and transposes here;
    training on CPU uses the loop (see grouped_mm_supported)."""
    args = _expert_inputs()
    ref = expert_swiglu(*args, use_grouped_mm=False)
    # float32, an expert's two projections (16 and 24 terms): Measured: uses 0.0029 of it (AVX-512), 0.0029 (AVX2 caps).
    grouped = expert_swiglu(*args, use_grouped_mm=True)
    torch.testing.assert_close(grouped, ref, **chain_tol(ref.abs().max().item(), 2, 24))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM kernel needs CUDA")
def test_grouped_gemm_equals_loop_on_cuda():
    from torchtitan.components.moe.experts import grouped_mm_supported

    if not grouped_mm_supported(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this GPU has no bf16 grouped GEMM (needs compute capability 9.0)")
    x, w1, w2, w3, counts = _expert_inputs(torch.bfloat16, "cuda")
    grads = []
    for grouped in (True, False):
        ws = [w.clone().requires_grad_() for w in (w1, w2, w3)]
        out = expert_swiglu(x, *ws, counts, use_grouped_mm=grouped)
        out.float().square().sum().backward()
        grads.append((out.detach().float(), [w.grad.float() for w in ws]))
    (o1, g1), (o2, g2) = grads
    # bf16 with float32 accumulation on both paths: each rounds the same intermediates (the SwiGLU input, the
    # output; the gradients' two) to bf16 once, from float32 values that differ by a reordering, so a rounded
    # value lands at most one bf16 ulp (2u) apart: two in a chain, 4u of bf16 (1.6e-2) of each tensor's scale.
    # Not measured here (CUDA only); a wrong expert offset moves outputs by O(1).
    for a, b in zip([o1, *g1], [o2, *g2]):
        torch.testing.assert_close(a, b, rtol=4 * BF16_U, atol=4 * BF16_U * b.abs().max().item())


def test_sequence_aux_loss_follows_its_definition():
    moe = _moe(aux_loss_alpha=0.1)
    x = torch.randn(3, 6, DIM)
    out = moe(x)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    weights, ids, scores = moe.router(x.reshape(-1, DIM), moe.expert_bias)
    ids, scores = ids.view(3, 6, 2), scores.view(3, 6, 8)
    total = 0.0
    for b in range(3):
        f = torch.tensor([(ids[b] == e).sum().item() for e in range(8)]) * 8 / (2 * 6)
        p = (scores[b] / scores[b].sum(-1, keepdim=True)).mean(0)
        total += 0.1 * (f * p).sum() * 6  # each of the sequence's 6 tokens carries its loss
    torch.testing.assert_close(out.aux_loss, total)
    out.aux_loss.backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_loads_counted_once_under_activation_checkpointing(family):
    """The model counts each layer's load between blocks, so full AC's recompute (the block's forward again
    inside backward) does not count it twice."""
    from torchtitan.config.job_config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(family)
    args = spec.flavors["debugmodel_tiny"]
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    apply_ac(model, ActivationCheckpoint(mode="full"))
    tokens = torch.randint(0, args.vocab_size, (2, 5))
    model(tokens).logits.sum().backward()  # recomputes every block inside backward
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.tokens_per_expert.sum() == 2 * 5 * m.args.top_k for m in moes)
