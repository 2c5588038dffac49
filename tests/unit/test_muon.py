"""Muon in one process: the Newton-Schulz orthogonalisation, which parameters use Muon, one optimizer step
against torch's own Muon and AdamW, checkpoint resume, and bad settings.

Orthogonality tolerance: five quintic steps do not converge to U V^T; by design they map every singular
value into about [0.7, 1.2] (Jordan's coefficients trade exactness for speed). So the tests check (a) the
result is exactly the polynomial acting on the singular values, with the singular vectors unchanged (fp32,
1e-5), and (b) every singular value of the result is within [0.6, 1.25], i.e. ||O O^T - I||_2 <= 0.6, for
tall and wide Gaussian matrices (aspect ratio 4: their smallest singular value is well away from zero).
"""

import copy
import functools
import os
import shutil

import pytest
import torch
from torch import nn

from tests.tolerances import chain_tol, optimizer_steps_tol
from tests.unit.checkpoint_helpers import losses, run
from torchtitan.components.optim import muon
from torchtitan.components.optim.optimizer import build_optimizers
from torchtitan.config.job_config import Optimizer


def _singular_value_map(s: torch.Tensor, steps: int) -> torch.Tensor:
    """What Newton-Schulz does to each singular value, computed on the values alone (float64)."""
    a, b, c = muon.NS_COEFFICIENTS
    x = s / s.square().sum().sqrt()  # dividing by the Frobenius norm
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return x


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (48, 48)])
def test_newton_schulz_is_the_polynomial_of_the_singular_values(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    expected = u @ torch.diag(_singular_value_map(s, 5)) @ vh
    got = muon.newton_schulz(g, 5, torch.float32)
    assert got.dtype == torch.float32 and got.shape == g.shape
    # float32 against float64: 5 iterations of 3 matmuls, each contracting at most max(shape) terms. Measured: uses
    # 0.071 of it (AVX-512), 0.071 (AVX2 caps).
    torch.testing.assert_close(got.double(), expected, **chain_tol(expected.abs().max().item(), 15, max(shape)))


@pytest.mark.parametrize("shape", [(32, 128), (128, 32)])
def test_newton_schulz_result_is_nearly_orthogonal(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 1e-3  # any scale: it is normalised
    o = muon.newton_schulz(g, 5, torch.float32)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.6 and s.max() < 1.25, s
    k = min(shape)
    gram = o @ o.T if shape[0] < shape[1] else o.T @ o
    assert torch.linalg.matrix_norm(gram - torch.eye(k), ord=2) <= 0.6
    # The input's own singular values span ~[0.5, 1.5] x their mean: far from orthogonal before.
    s_in = torch.linalg.svdvals(g)
    assert s_in.max() / s_in.min() > 2.5


def test_auto_ns_dtype_is_bf16_on_cuda_only():
    assert muon.ns_dtype_for("auto", torch.device("cuda")) == torch.bfloat16
    assert muon.ns_dtype_for("auto", torch.device("cpu")) == torch.float32
    assert muon.ns_dtype_for("bfloat16", torch.device("cpu")) == torch.bfloat16


def _llama_tiny() -> nn.Module:
    from torchtitan.models.llama3 import Transformer, llama3_flavors

    with torch.device("meta"):
        return Transformer(llama3_flavors["debugmodel_tiny"])


def test_default_split_blocks_matrices_to_muon_rest_to_adamw():
    model = _llama_tiny()
    muon_names = {n for n, p in model.named_parameters() if muon.default_is_muon_param(n, p)}
    per_block = {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                 "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"}
    assert muon_names == {f"layers.{i}.{n}" for i in model.layers for n in per_block}
    adamw_names = {n for n, _ in model.named_parameters()} - muon_names
    assert {"tok_embeddings.weight", "output.weight", "norm.weight", "layers.0.attention_norm.weight"} <= adamw_names
    assert all("norm" in n or n in ("tok_embeddings.weight", "output.weight") for n in adamw_names)


def _block_model() -> nn.Module:
    """Two 'blocks' with matrices and biases, an embedding and a head, named like a transformer."""
    torch.manual_seed(0)
    model = nn.Module()
    model.tok_embeddings = nn.Embedding(10, 8)
    model.layers = nn.ModuleDict({"0": nn.Linear(8, 24), "1": nn.Linear(24, 8)})
    model.output = nn.Linear(8, 10, bias=False)
    return model


def _forward(model, tokens):
    x = model.tok_embeddings(tokens)
    for layer in model.layers.values():
        x = torch.tanh(layer(x))
    return model.output(x)


def _batches(n):
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 10, (4, 6), generator=g), torch.randint(0, 10, (4, 6), generator=g)) for _ in range(n)]


def _train(model, opt, batches):
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(_forward(model, x).flatten(0, 1), y.flatten()).backward()
        opt.step()


def test_groups_follow_the_rule_and_a_model_can_override_it():
    model = _block_model()
    opt = build_optimizers([model], Optimizer(name="Muon")).optimizers[0]
    muon_group, adamw_group = opt.param_groups
    assert muon_group["use_muon"] and not adamw_group["use_muon"]
    assert {id(p) for p in muon_group["params"]} == {id(model.layers["0"].weight), id(model.layers["1"].weight)}
    # A spec's own rule, passed the way a TrainSpec hook would: the head joins Muon.
    own = functools.partial(build_optimizers, is_muon_param=lambda n, p: p.ndim == 2 and n != "tok_embeddings.weight")
    groups = own([model], Optimizer(name="Muon")).optimizers[0].param_groups
    assert id(model.output.weight) in {id(p) for p in groups[0]["params"]}


def _fp32_torch_newton_schulz(grad, ns_coefficients, ns_steps, eps):
    return muon.newton_schulz(grad, ns_steps, torch.float32, eps)


def test_steps_match_torch_muon_for_matrices_and_torch_adamw_for_the_rest(monkeypatch):
    """The momentum, Nesterov, decoupled weight decay and the 0.2 * sqrt(max(m, n)) scale agree with
    torch.optim.Muon(adjust_lr_fn="match_rms_adamw") (its Newton-Schulz switched to fp32 so both run
    the same orthogonalisation); every other parameter matches torch.optim.AdamW."""
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _fp32_torch_newton_schulz)
    cfg = Optimizer(name="Muon", lr=1e-2, weight_decay=0.1, implementation="for-loop", muon_ns_dtype="float32")
    model = _block_model()
    reference = copy.deepcopy(model)
    ours = build_optimizers([model], cfg)
    matrices = [reference.layers["0"].weight, reference.layers["1"].weight]
    rest = [p for p in reference.parameters() if all(p is not m for m in matrices)]
    theirs = [
        torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, momentum=0.95, nesterov=True,
                         adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=1e-2, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=0.1,
                          foreach=False),
    ]

    class Both:
        def zero_grad(self):
            for o in theirs:
                o.zero_grad()

        def step(self):
            for o in theirs:
                o.step()

    batches = _batches(4)
    _train(model, ours, batches)
    _train(reference, Both(), batches)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        # Same Newton-Schulz code on both sides; the momentum, Nesterov, decay, scale and AdamW's update are
        # elementwise in another order, and Newton-Schulz multiplies a momentum's difference along its small
        # singular directions by its linear coefficient a per iteration (a^5 = 485). Measured: uses 0.0049 of it
        # (AVX-512), 0.0054 (AVX2 caps).
        tol = optimizer_steps_tol(len(batches), cfg.lr, condition=muon.NS_COEFFICIENTS[0] ** cfg.muon_ns_steps)
        torch.testing.assert_close(p, q, **tol, msg=name)
    assert not torch.equal(model.layers["0"].weight, _block_model().layers["0"].weight)  # it did train


def test_state_dict_round_trip_resumes_identically():
    cfg = Optimizer(name="Muon", lr=1e-2)
    batches = _batches(6)
    straight = _block_model()
    straight_opt = build_optimizers([straight], cfg)
    _train(straight, straight_opt, batches)

    first = _block_model()
    first_opt = build_optimizers([first], cfg)
    _train(first, first_opt, batches[:3])
    state = first_opt.state_dict()
    assert "state.layers.0.weight.momentum_buffer" in state and "state.output.weight.exp_avg" in state

    resumed = _block_model()
    resumed.load_state_dict(first.state_dict())
    resumed_opt = build_optimizers([resumed], cfg)
    resumed_opt.load_state_dict(state)
    _train(resumed, resumed_opt, batches[3:])
    for (name, p), q in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(p, q), name


MUON = ["--optimizer.name", "Muon", "--optimizer.lr", "1e-2"]


def test_trainer_checkpoint_resume_continues_the_same_run(tmp_path):
    """Through the trainer and DCP: a run resumed from its step-2 checkpoint logs the same losses for
    steps 3-4 as the uninterrupted run (the momentum buffers and Adam moments round-trip)."""
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4"]
    assert run(tmp_path / "straight", *MUON, *ckpt) == 0
    straight = losses(tmp_path / "straight")
    assert len(straight) == 4
    from torchtitan.components.checkpoint.manager import read_dcp_metadata

    step2 = tmp_path / "straight" / "checkpoint" / "step-2"
    keys = read_dcp_metadata(str(step2)).state_dict_metadata
    assert "optimizer.state.layers.0.attention.wq.weight.momentum_buffer" in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys

    shutil.copytree(step2, tmp_path / "resumed" / "checkpoint" / "step-2")
    assert run(tmp_path / "resumed", *MUON, *ckpt) == 0
    assert losses(tmp_path / "resumed") == straight[2:]


@pytest.mark.parametrize("argv, message", [
    (["--optimizer.muon_momentum", "1.0"], "--optimizer.muon_momentum must be in [0, 1)"),
    (["--optimizer.muon_update_rms", "0"], "--optimizer.muon_update_rms must be positive"),
])
def test_bad_muon_setting_is_one_line(tmp_path, capsys, argv, message):
    """(muon_ns_steps 0 is in test_preflight.py's list of jobs both the pre-flight check and trainer refuse.)"""
    assert run(tmp_path, "--optimizer.name", "Muon", "--training.steps", "1", *argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and message in err[0], err
    assert not os.path.exists(tmp_path / "metrics.jsonl")
