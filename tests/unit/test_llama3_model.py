import copy
import dataclasses
import math

import pytest
import torch

from tests.tolerances import BLOCK_CONTRACTIONS, FP32_U, attention_tol, chain_tol, contraction_width
from torchtitan.tools.params import count_params

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs
from torchtitan.models.llama3.flavors import llama3_flavors
from torchtitan.models.llama3.model import (
    Transformer,
    apply_rope,
    precompute_rope_cache,
    rope_frequencies,
)

TINY = TransformerModelArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16,
    rope_theta=500000, rope_scaling=RopeScalingArgs(original_max_position_embeddings=16), max_seq_len=64,
)


def build(args: TransformerModelArgs, seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def reference_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Meta's reference: pairs as complex numbers times e^{i * pos * freq}."""
    rot = torch.polar(torch.ones(len(positions), len(freqs), dtype=torch.float64), torch.outer(positions.double(), freqs))
    xc = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rot[None, :, None, :]).flatten(-2).float()


def test_rope_matches_complex_reference():
    torch.manual_seed(0)
    x = torch.randn(2, 10, 3, 8)
    freqs = rope_frequencies(8, 10000.0, None)
    cache = precompute_rope_cache(8, 10, 10000.0, None)
    # A bound, not a reordering: each float32 output is x cos - y sin of an angle rounded in float32 (off by
    # u theta, theta <= 9 rad here) and 3 more roundings, against a float64 reference: (9 + 3) u |(x, y)|.
    # Measured: 2.4e-7 at most, both kernel sets (bound 4e-6); a wrong pairing moves it by O(|x|).
    bound = (9 + 3) * FP32_U * 2**0.5 * x.abs().max().item()
    torch.testing.assert_close(apply_rope(x, cache), reference_rope(x, torch.arange(10), freqs), atol=bound, rtol=0)


def test_rope_at_positions_equals_rows_of_full_rope():
    torch.manual_seed(0)
    cache = precompute_rope_cache(8, 64, 10000.0, RopeScalingArgs())
    x = torch.randn(2, 64, 3, 8)
    full = apply_rope(x, cache)
    pos = torch.tensor([40, 3, 17, 63, 0])
    # elementwise on the same rows of the same cache: bitwise (a default tolerance would hide a cache row off by
    # one position at small angles)
    torch.testing.assert_close(apply_rope(x[:, pos], cache[pos]), full[:, pos], rtol=0, atol=0)
    # Per-sample positions [B, S]: each batch row gathers its own rows.
    pos_b = torch.stack([pos, pos.flip(0)])
    out = apply_rope(torch.stack([x[0, pos], x[1, pos.flip(0)]]), cache[pos_b])
    torch.testing.assert_close(out, torch.stack([full[0, pos], full[1, pos.flip(0)]]), rtol=0, atol=0)


def test_llama31_frequency_scaling_per_frequency():
    s = RopeScalingArgs(factor=8, low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192)
    head_dim, theta = 128, 500000.0
    expected = []
    for i in range(head_dim // 2):
        f = theta ** (-2 * i / head_dim)
        wavelen = 2 * math.pi / f
        if wavelen < s.original_max_position_embeddings / s.high_freq_factor:
            expected.append(f)
        elif wavelen > s.original_max_position_embeddings / s.low_freq_factor:
            expected.append(f / s.factor)
        else:
            t = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            expected.append(f * (t + (1 - t) / s.factor))
    got = rope_frequencies(head_dim, theta, s)
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    # The three regimes are all exercised.
    unscaled = rope_frequencies(head_dim, theta, None)
    ratio = got / unscaled
    assert (ratio == 1).any() and (ratio == 1 / 8).any() and ((ratio > 1 / 8) & (ratio < 1)).any()


def test_rmsnorm_matches_formula():
    model = build(TINY)
    norm = model.norm
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, TINY.dim)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + TINY.norm_eps) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_attention_matches_explicit_softmax_with_gqa():
    torch.manual_seed(0)
    B, Hq, Hkv, S, D = 2, 6, 2, 7, 8
    q, k, v = torch.randn(B, Hq, S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
    out = ScaledDotProductAttention()(q, k, v)
    mask = torch.ones(S, S, dtype=torch.bool).tril()
    for h in range(Hq):
        g = h // (Hq // Hkv)
        scores = q[:, h] @ k[:, g].transpose(-1, -2) / math.sqrt(D)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        ref = probs @ v[:, g]
        # Measured: uses 0.037 of it (AVX-512), 0.037 (AVX2 caps).
        torch.testing.assert_close(out[:, h], ref, **attention_tol(ref, S, D))


def test_swiglu_hidden_dim_and_8b_param_count():
    args = llama3_flavors["8B"]
    assert args.hidden_dim == 14336
    with torch.device("meta"):
        model = Transformer(args)
    total, non_embedding = count_params(model)
    assert total == 8_030_261_248
    assert total - non_embedding == 128256 * 4096


def test_flops_per_token():
    args = llama3_flavors["debugmodel"]
    model = build(args)
    _, n = count_params(model)
    assert n == sum(p.numel() for name, p in model.named_parameters() if name != "tok_embeddings.weight")
    head_dim = 256 // 16
    assert args.flops_per_token(n, 2048) == 6 * n + 12 * 6 * 16 * head_dim * 2048


def test_all_flavors_build_on_meta():
    for name, args in llama3_flavors.items():
        with torch.device("meta"):
            model = Transformer(args)
        assert len(model.layers) == args.n_layers, name


def test_positions_none_equals_arange_and_shift_invariance():
    model = build(TINY)
    with torch.no_grad():  # sharpen attention so that positions visibly matter
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(30)
            layer.attention.wk.weight.mul_(30)
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, TINY.vocab_size)
    torch.testing.assert_close(model(tokens, positions=torch.arange(12)), logits)
    # RoPE is relative: shifting every position by the same offset leaves attention, hence logits, unchanged,
    # while the rotation of individual keys does change (so positions are actually used).
    shifted = torch.arange(12) + 30
    # Same model and kernels, other RoPE angles: each angle is rounded in float32, off by u theta with theta up
    # to 12 + 30 rad, as much as the random walk of a sum of theta^2 terms: the chain of a forward pass whose
    # longest contraction is 42^2 terms. Measured: uses 0.00078 of it (AVX-512), 0.00078 (AVX2 caps).
    depth = BLOCK_CONTRACTIONS * TINY.n_layers + 2
    tol = chain_tol(logits.abs().max().item(), depth, max(contraction_width(model, 12), (12 + 30) ** 2))
    torch.testing.assert_close(model(tokens, positions=shifted), logits, **tol)
    per_row = torch.stack([torch.arange(12), torch.arange(12) + 5])
    torch.testing.assert_close(model(tokens, positions=per_row), logits, **tol)
    jumbled = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 10])
    # swapping the last two positions moves their logits by 2.6e-2, 65x the tolerance
    assert (model(tokens, positions=jumbled) - logits).abs().max() > 10 * tol["atol"]


def test_deleted_layers_keep_fqns():
    model = build(TINY)
    del model.layers["1"]
    model.tok_embeddings = None
    names = set(dict(model.named_parameters()))
    assert "layers.3.attention.wq.weight" in names
    assert "layers.0.feed_forward.w2.weight" in names
    assert not any(n.startswith("layers.1.") or n.startswith("tok_embeddings") for n in names)
    # Without embeddings the input is hidden states.
    assert model(torch.randn(2, 5, TINY.dim)).shape == (2, 5, TINY.vocab_size)


def split(model: Transformer, k: int) -> tuple[Transformer, Transformer]:
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(len(model.layers)):
        del (second if i <= k else first).layers[str(i)]
    first.norm = first.output = None
    second.tok_embeddings = None
    return first, second


def test_split_model_chained_equals_whole():
    model = build(TINY)
    first, second = split(model, 1)
    assert list(first.layers) == ["0", "1"] and list(second.layers) == ["2", "3"]
    tokens = torch.randint(0, TINY.vocab_size, (2, 9))
    hidden = first(tokens)
    assert hidden.shape == (2, 9, TINY.dim)
    torch.testing.assert_close(second(hidden), model(tokens), rtol=0, atol=0)  # the same kernels in order: bitwise


def test_init_is_deterministic_and_follows_scheme():
    a, b, c = build(TINY, seed=1), build(TINY, seed=1), build(TINY, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if "norm" not in name:
            assert not torch.equal(pa, pc), name
    torch.testing.assert_close(a.rope_cache, precompute_rope_cache(TINY.head_dim, 64, TINY.rope_theta, TINY.rope_scaling))
    assert all(torch.equal(m.weight, torch.ones(TINY.dim)) for n, m in a.named_modules() if n.endswith("norm"))
    # Output: truncated at 3 std of dim^-0.5; depth init: deeper layers get smaller wo.
    assert a.output.weight.abs().max() <= 3 * TINY.dim**-0.5
    assert a.layers["3"].attention.wo.weight.abs().max() <= 3 * 0.02 / math.sqrt(8)
    big = build(dataclasses.replace(TINY, dim=256, n_heads=8), seed=0)
    assert abs(big.tok_embeddings.weight.std().item() - 1.0) < 0.02
    assert abs(big.layers["0"].attention.wq.weight.std().item() - 0.02) < 0.001


def test_stage_without_parts_initialises():
    with torch.device("meta"):
        model = Transformer(TINY)
    _, stage = split(model, 1)
    stage.to_empty(device="cpu")
    torch.manual_seed(0)
    stage.init_weights()
    assert all(torch.isfinite(p).all() for p in stage.parameters())
    assert stage(torch.randn(1, 4, TINY.dim)).shape == (1, 4, TINY.vocab_size)


def test_backward_reaches_all_params():
    model = build(TINY)
    model(torch.randint(0, TINY.vocab_size, (2, 6))).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_tiny"])
def test_debug_flavors_forward(flavor):
    args = llama3_flavors[flavor]
    model = build(args)
    assert model(torch.randint(0, args.vocab_size, (1, 16))).shape == (1, 16, args.vocab_size)
