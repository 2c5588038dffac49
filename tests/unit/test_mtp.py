"""Multi-token prediction (models/common/mtp.py, DeepSeek-V3's `mtp_depth`) against the paper's equations.

The reference below is written from DeepSeek-V3's section 2.2 (arXiv 2412.19437), position by position:
    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)]      (the checkpoints' order of the halves)
    h^k_{1:T-k} = TRM_k(h'^k_{1:T-k})                              (the block runs on the T-k positions only)
    P^k_{i+k+1} = OutHead(h^k_i),  L^k = -1/T sum_{i=2+k}^{T+1} log P^k_i[t_i],  L = L_main + lambda/D sum_k L^k
with its own RMSNorm and cross entropy; our model pads the shifted sequence instead of truncating it, so the
comparison also shows that the padded tail never reaches a trained position.
"""

import dataclasses

import pytest
import torch

from tests.tolerances import contraction_width, logits_tol
from torchtitan.components.loss import cross_entropy_sum, mtp_labels, token_and_mtp_loss
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_flavors
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model

ARGS = dataclasses.replace(deepseek_v3_flavors["debugmodel_tiny"], vocab_size=80, n_layers=2, mtp_depth=1,
                           mtp_loss_weight=0.3)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _model(args=ARGS, perturb_norms: bool = True) -> DeepSeekV3Model:
    with torch.device("meta"):  # as the trainer builds it: only init_weights draws random numbers
        model = DeepSeekV3Model(args)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device=torch.device("cpu"))
    if perturb_norms:
        with torch.no_grad():  # norms away from ones, so swapping or dropping one shows
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def _paper_loss(model: DeepSeekV3Model, tokens: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """L_main + lambda/D * L^1 for sequences t_1..t_T (tokens) with t_{T+1} (the window's last label)."""
    a = model.model_args
    bsz, T = tokens.shape
    t = torch.cat((tokens, next_tokens[:, None]), dim=1)  # t[:, j] = t_{j+1} (0-based)
    emb = model.tok_embeddings.weight
    h = emb[tokens]
    for layer in model.layers.values():
        h, _ = layer(h, model.rope_cache, None)
    h0 = _rms(h, model.norm.weight, a.norm_eps)
    head = model.output.weight
    logp_main = torch.log_softmax(h0 @ head.T, dim=-1)
    main = -sum(logp_main[b, i, t[b, i + 1]] for b in range(bsz) for i in range(T)) / (bsz * T)
    depth = model.mtp.depths[0]
    k = 1
    # h'_i for i = 1..T-k: the previous depth's state and the embedding of t_{i+k}
    combined = torch.stack([
        torch.stack([
            torch.cat((_rms(emb[t[b, i + k]], depth.enorm.weight, a.norm_eps),
                       _rms(h0[b, i], depth.hnorm.weight, a.norm_eps))) @ depth.eh_proj.weight.T
            for i in range(T - k)
        ]) for b in range(bsz)
    ])
    hk, _ = depth.block(combined, model.rope_cache, None)  # TRM_k on the T-k positions
    logp = torch.log_softmax(_rms(hk, depth.norm.weight, a.norm_eps) @ head.T, dim=-1)
    # P^k_i predicts t_{i+k+1}
    mtp = -sum(logp[b, i, t[b, i + k + 1]] for b in range(bsz) for i in range(T - k)) / (bsz * T)
    return main + a.mtp_loss_weight / a.mtp_depth * mtp


def test_depth_one_loss_equals_the_papers_equations():
    torch.set_default_dtype(torch.float32)
    model = _model()
    seqs = torch.randint(0, ARGS.vocab_size, (2, 13), generator=torch.Generator().manual_seed(3))
    tokens, labels = seqs[:, :-1], seqs[:, 1:]
    out = model(tokens)
    assert len(out.mtp_logits) == 1
    ours, sums = token_and_mtp_loss(cross_entropy_sum, out.logits, out.mtp_logits, labels, model.mtp_loss_weight)
    ours = ours / labels.numel()
    with torch.no_grad():
        expected = _paper_loss(model, tokens, labels[:, -1])
    # The trunk is the same code on both sides; the head, the MTP block and the two losses (log-softmax over
    # the vocabulary, a mean over tokens) are written out: a forward pass of one block. Measured: uses 0.0023 of it
    # (AVX-512), 0.0023 (AVX2 caps).
    torch.testing.assert_close(ours.detach(), expected, **logits_tol(expected, 1, contraction_width(model, 12)))
    assert sums[1].tolist() == [2 * 11]  # depth 1 trains T - 1 positions per sequence
    # the MTP term matters at this tolerance: without it, or with the halves swapped, the loss differs
    main_only = cross_entropy_sum(out.logits, labels) / labels.numel()
    assert (main_only.detach() - expected).abs() > 1e-3
    # and its gradient reaches the main model and the shared embedding through the MTP module
    ours.backward()
    d = model.mtp.depths[0]
    assert d.eh_proj.weight.grad.abs().sum() > 0 and d.enorm.weight.grad.abs().sum() > 0


def test_halves_swapped_fail_the_reference():
    """Negative control: the paper's notation [h; e] read literally into the checkpoint's eh_proj differs."""
    model = _model()
    seqs = torch.randint(0, ARGS.vocab_size, (1, 9), generator=torch.Generator().manual_seed(4))
    tokens, labels = seqs[:, :-1], seqs[:, 1:]
    with torch.no_grad():
        expected = _paper_loss(model, tokens, labels[:, -1])
        w = model.mtp.depths[0].eh_proj.weight
        w.copy_(torch.cat((w[:, ARGS.dim:], w[:, :ARGS.dim]), dim=1))
        out = model(tokens)
        swapped, _ = token_and_mtp_loss(cross_entropy_sum, out.logits, out.mtp_logits, labels, ARGS.mtp_loss_weight)
    assert (swapped / labels.numel() - expected).abs() > 1e-4


def test_mtp_labels_and_depths():
    labels = torch.arange(6).view(1, 6)
    assert mtp_labels(labels, 2).tolist() == [[2, 3, 4, 5, -100, -100]]
    model = _model(dataclasses.replace(ARGS, mtp_depth=2))
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    out = model(tokens)
    assert [t.shape for t in out.mtp_logits] == [out.logits.shape] * 2
    _, sums = token_and_mtp_loss(cross_entropy_sum, out.logits, out.mtp_logits, tokens, 0.1)
    assert sums[1].tolist() == [2 * 7, 2 * 6]
    # the main logits do not depend on the MTP module, and eval (validation, generation) skips it
    model.eval()
    with torch.no_grad():
        evaluated = model(tokens)
    assert evaluated.mtp_logits == []
    torch.testing.assert_close(evaluated.logits, out.logits.detach())


@pytest.mark.parametrize("depth", [0, 2])
def test_main_weights_initialise_the_same_with_or_without_mtp(depth):
    plain = _model(dataclasses.replace(ARGS, mtp_depth=0), perturb_norms=False)
    with_mtp = _model(dataclasses.replace(ARGS, mtp_depth=depth), perturb_norms=False)
    ours = with_mtp.state_dict()
    for key, t in plain.state_dict().items():
        torch.testing.assert_close(ours[key], t, rtol=0, atol=0)


BAD = {
    "MTP depth on a family without it": (
        1, ["--model.name", "llama3", "--model.flavor", "debugmodel_tiny4", "--model.overrides", "mtp_depth=1"],
        "model llama3 has no mtp_depth (an option of deepseek_v3)"),
    "MTP under tensor parallel": (
        2, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny", "--model.overrides", "mtp_depth=1",
            "--parallelism.tensor_parallel_degree", "2"], "runs with FSDP and pipeline parallel only"),
    "negative depth": (
        1, ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_tiny", "--model.overrides", "mtp_depth=-1"],
        "the depth must be >= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mtp_settings_are_refused_in_one_line_before_any_rank_starts(case, capsys):
    from torchtitan import preflight

    world, argv, says = BAD[case]
    assert preflight.main(["--world-size", str(world), "--training.seq_len", "32", "--training.local_batch_size",
                           "4", "--training.mixed_precision_param", "float32"] + argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and says in err, err


def test_generation_reads_the_main_logits_only():
    """scripts/checkpoints/generate.py's sampler gives the same tokens with the MTP module as without it."""
    from torchtitan.tools.generation import generate

    plain = _model(dataclasses.replace(ARGS, mtp_depth=0), perturb_norms=False)
    with_mtp = _model(ARGS, perturb_norms=False)
    runs = [generate(m, [1, 2, 3], max_new_tokens=4, max_seq_len=16) for m in (plain, with_mtp)]
    assert runs[0] == runs[1] and len(runs[0]) == 4
