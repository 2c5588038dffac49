"""Activation checkpointing saves memory and never changes the numbers.

Numbers: every mode trains the same fp32 model on the same batches for several AdamW steps, and the losses and
final weights must be bitwise equal to no-AC (recomputation runs the same kernels on the same inputs).
Memory: on the debugmodel at seq 2048, what a forward leaves for backward per block must fall to a third or
less under full AC, with the op-level policy in between.
"""

import ctypes
import dataclasses
import gc
import sys

import pytest
import torch

from tests.unit.tiny_batches import random_batch_loss
from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.job_config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.tools.activation_memory import activation_bytes

MODES = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "selective_op": ActivationCheckpoint(mode="selective", selective_ac_option="op"),
    "selective_2": ActivationCheckpoint(mode="selective", selective_ac_option="2"),
}


def _model(flavor: str, ac: ActivationCheckpoint, n_layers: int | None = None) -> Transformer:
    args = llama3_flavors[flavor]
    if n_layers is not None:
        args = dataclasses.replace(args, n_layers=n_layers)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_ac(model, ac)
    return model


def _train(ac: ActivationCheckpoint, steps: int = 4, perturb=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model("debugmodel_tiny", ac, n_layers=4)
    if perturb is not None:
        perturb(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = random_batch_loss(model, gen)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def no_ac_run():
    return _train(MODES["none"])


@pytest.mark.parametrize("mode", ["full", "selective_op", "selective_2"])
def test_ac_is_bitwise_identical_to_no_ac(mode, no_ac_run):
    ref_losses, ref_state = no_ac_run
    losses, state = _train(MODES[mode])
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()  # the wrapper does not leak into parameter names
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k


def _nudge_one_weight(model: Transformer) -> None:
    with torch.no_grad():
        w = model.layers["0"].attention.wq.weight.view(-1)
        w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))


def test_equality_check_has_teeth(no_ac_run):
    """One weight one ulp off at the start must be visible to the same comparison: a recomputation that
    differed at all would be caught."""
    _, ref_state = no_ac_run
    _, state = _train(MODES["full"], perturb=_nudge_one_weight)
    assert any(not torch.equal(state[k], ref_state[k]) for k in ref_state)


@pytest.fixture(scope="module")
def block_bytes():
    """Bytes left for backward per block, debugmodel, batch 1 x seq 2048, fp32, for each mode."""
    out = {}
    for name, ac in MODES.items():
        model = _model("debugmodel", ac)
        tokens = torch.randint(0, model.model_args.vocab_size, (1, 2049), generator=torch.Generator().manual_seed(0))
        per_tag = activation_bytes(model, lambda: cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]))
        out[name] = [per_tag[k] for k in model.layers.keys()]
    yield out
    # Hand the ~0.5 GiB these forwards used back to the OS: tests that measure process RSS run in this process.
    del model
    gc.collect()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def test_full_ac_keeps_a_third_or_less_per_block(block_bytes):
    none, full = block_bytes["none"], block_bytes["full"]
    # Full AC keeps the block input only: one [B, S, dim] fp32 tensor.
    assert all(f == 1 * 2048 * 256 * 4 for f in full), full
    assert all(f * 3 <= n for f, n in zip(full, none)), (full, none)


def test_selective_modes_lie_between(block_bytes):
    none, full = block_bytes["none"], block_bytes["full"]
    op = block_bytes["selective_op"]
    assert all(f < o < n for f, o, n in zip(full, op, none)), (full, op, none)
    every2 = block_bytes["selective_2"]
    assert every2 == [n if i % 2 == 0 else f for i, (n, f) in enumerate(zip(none, full))]


def test_bad_settings_fail_with_one_line():
    model = _model("debugmodel_tiny", MODES["none"])
    with pytest.raises(ValueError, match="selective_ac_option"):
        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="every"))
    with pytest.raises(ValueError, match="selective_ac_option"):
        apply_ac(model, ActivationCheckpoint(mode="selective", selective_ac_option="0"))
    with pytest.raises(ValueError, match="compile.enable"):
        apply_ac(model, ActivationCheckpoint(mode="memory_budget"))
    with pytest.raises(ValueError, match="memory_budget"):
        apply_ac(model, ActivationCheckpoint(mode="memory_budget", memory_budget=1.5), model_compiled=True)
