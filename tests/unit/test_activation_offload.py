"""Activation offload moves what a block saves for backward out of RAM and never changes the numbers.

Numbers: a 4-block fp32 model trains 4 AdamW steps with blocks offloaded (alone, and mixed with keep / op /
full recompute); losses and final weights must be bitwise equal to no-AC. A tier that returns one bit wrong
must be caught by the same comparison (negative control).
Memory: what a forward leaves alive per offloaded block, once its group is written, is nothing; a block that
recomputes from an offloaded input (full_offload) keeps nothing either, where full AC keeps its input.
"""

import dataclasses

import pytest
import torch

from tests.unit.tiny_batches import random_batch_loss
from torchtitan.components.loss import cross_entropy_sum
from torchtitan.config.job_config import ActivationCheckpoint, Memory
from torchtitan.distributed import activation_offload
from torchtitan.distributed.activation_checkpoint import apply_block_choices, check_block_choices
from torchtitan.models.llama3 import Transformer, llama3_flavors
from torchtitan.tools.activation_memory import activation_bytes


def _model(choices: list[str], tmp_path, n_layers: int = 4, prefetch: bool = True) -> Transformer:
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=n_layers)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    apply_block_choices(model, choices, torch.device("cpu"), str(tmp_path), prefetch)
    return model


def _train(choices: list[str], tmp_path, steps: int = 4, prefetch: bool = True):
    model = _model(choices, tmp_path, prefetch=prefetch)
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
def no_ac_run(tmp_path_factory):
    return _train([], tmp_path_factory.mktemp("keep"))


@pytest.mark.parametrize("choices, prefetch", [
    (["offload"], True), (["offload", "keep", "full", "op"], True), (["keep", "offload", "offload", "full"], False),
    (["full_offload", "offload", "full", "full_offload"], True)])
def test_offload_is_bitwise_identical_to_no_ac(choices, prefetch, no_ac_run, tmp_path):
    ref_losses, ref_state = no_ac_run
    losses, state = _train(choices, tmp_path, prefetch=prefetch)
    assert losses == ref_losses
    assert state.keys() == ref_state.keys()  # the wrapper does not leak into parameter names
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k
    assert list(tmp_path.glob("torchtitan-offload-*/*")) == []  # every group was read back and its file removed


def test_a_tier_that_corrupts_one_bit_is_caught(no_ac_run, tmp_path, monkeypatch):
    read = activation_offload.FileTier._read

    def flip_a_bit(written, nbytes):
        buf = read(written, nbytes)
        buf[2] ^= 0x40  # the top mantissa bit of the group's first float32
        return buf

    monkeypatch.setattr(activation_offload.FileTier, "_read", staticmethod(flip_a_bit))
    losses, state = _train(["offload"], tmp_path)
    assert losses[0] == no_ac_run[0][0]  # the forward is untouched...
    # ...the gradients computed from what the tier gave back are not: the trained weights differ (the losses
    # may not show it within 4 steps, as Adam's first updates are lr x the sign of the gradient)
    assert any(not torch.equal(state[k], no_ac_run[1][k]) for k in state)


def test_offloaded_blocks_leave_nothing_resident(tmp_path):
    """seq 256 fp32: no-AC blocks keep hundreds of KiB each; an offloaded block nothing, once written."""
    model = _model(["keep", "offload", "offload", "keep"], tmp_path)
    tokens = torch.randint(0, 2048, (1, 257), generator=torch.Generator().manual_seed(0))
    offloader = model.layers["1"].offloader

    def forward_then_flush():
        loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
        for g in offloader.groups:
            g.written.result()
        return loss

    per_block = activation_bytes(model, forward_then_flush)
    assert per_block["0"] > 100_000 and per_block["3"] > 100_000, per_block
    # Block 1's output is saved (offloaded) by block 2; block 2's output is block 3's input, which block 3 keeps.
    assert per_block["1"] == 0 and per_block["2"] == 256 * 64 * 4, per_block


@pytest.mark.parametrize("recompute, kept", [("full_offload", 0), ("full", 256 * 64 * 4)])
def test_a_recomputed_block_offloads_its_input(recompute, kept, tmp_path):
    """Block 1's output is block 2's input: full AC keeps it for block 2's recomputation (the control),
    full_offload moves it to the tier (nothing of block 1 stays alive); block 2's output is block 3's input,
    which block 3 keeps either way."""
    model = _model(["keep", recompute, recompute, "keep"], tmp_path)
    tokens = torch.randint(0, 2048, (1, 257), generator=torch.Generator().manual_seed(0))
    per_block = activation_bytes(model, lambda: cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]))
    assert per_block["1"] == kept and per_block["2"] == 256 * 64 * 4, per_block


def test_bad_choices_fail_with_one_line():
    none = ActivationCheckpoint()
    with pytest.raises(ValueError, match="'swap' is not a choice"):
        check_block_choices(Memory(block_choices=["swap"]), none, 4)
    with pytest.raises(ValueError, match="3 entries for a model of 4 blocks"):
        check_block_choices(Memory(block_choices=["keep", "full", "offload"]), none, 4)
    with pytest.raises(ValueError, match="cannot compose with --activation_checkpoint.mode full"):
        check_block_choices(Memory(block_choices=["offload"]), ActivationCheckpoint(mode="full"), 4)
    with pytest.raises(ValueError, match="drop --memory.block_choices"):
        check_block_choices(Memory(budget_gib=1.0, block_choices=["offload"]), none, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned-host tier needs a CUDA device")
def test_pinned_host_offload_is_bitwise_identical_on_cuda(tmp_path):
    """CUDA: saved tensors to pinned host memory on a side stream and back; gradients equal keep's."""
    def grads(choices):
        args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=4)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Transformer(args)
            model.init_weights()
        apply_block_choices(model, choices, torch.device("cuda", torch.cuda.current_device()))
        tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1)).cuda()
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads([]), grads(["offload"])):
        assert torch.equal(a, b)


def test_offload_around_compiled_blocks_is_bitwise_identical(tmp_path):
    """The wrapper stays outside the compiled region (apply_compile compiles the block inside it); the
    compiled blocks' saved tensors still go through the tier. AOTAutograd without inductor (aot_eager) keeps
    the test cheap: the saved tensors pass through the same compiled autograd function either way."""
    from torchtitan.distributed.compile import apply_compile

    def run(choices):
        model = _model(choices, tmp_path, n_layers=2)
        apply_compile(model, backend="aot_eager")
        tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1))
        cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        if choices:  # the block inside was compiled, not the wrapper
            assert model.layers["0"]._compiled_call_impl is None
            assert model.layers["0"].compile_target._compiled_call_impl is not None
        written = model.layers["0"].offloader.tier._count if choices else 0
        return [p.grad.clone() for p in model.parameters()], written

    ref, _ = run([])
    got, written = run(["offload"])
    assert written == 2
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
