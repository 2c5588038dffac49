"""Optimizer-state offload keeps AdamW's moments in files between steps and never changes the numbers.

A 3-block fp32 model trains 3 steps (two param groups, the LR changed between steps as a schedule does) with
the state streamed per block from files: losses and final weights must be bitwise equal to the plain
optimizer's, for the foreach and the fused kernel. A tier that returns one bit wrong must be caught by the same
comparison (negative control). Between steps only the step counters stay in the optimizer.
"""

import dataclasses

import pytest
import torch

from tests.unit.tiny_batches import random_batch_loss
from torchtitan.components.optim.optimizer_offload import OffloadedOptimizerState, parameter_chunks
from torchtitan.distributed import activation_offload
from torchtitan.models.llama3 import Transformer, llama3_flavors


def _train(tmp_path, offload: bool, fused: bool, steps: int = 3):
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=3)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    rest = [p for n, p in model.named_parameters() if "norm" not in n]
    opt = torch.optim.AdamW([{"params": rest}, {"params": norms, "weight_decay": 0.0}], lr=1e-2,
                            fused=fused, foreach=None if fused else True)
    state = OffloadedOptimizerState(model, str(tmp_path)) if offload else None
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        loss = random_batch_loss(model, gen)
        loss.backward()
        state.step(opt) if state else opt.step()
        opt.zero_grad()
        for g in opt.param_groups:
            g["lr"] *= 0.7
        losses.append(loss.item())
        if state:  # between steps the moments are in files: only the step counters stay
            for chunk in state.chunks:
                chunk.written.result()
            assert all(set(opt.state[p]) == {"step"} for p in model.parameters())
            assert len(list(tmp_path.glob("torchtitan-offload-*/*"))) == len(state.chunks)
    if state:
        state.load_all(opt)
    moments = {n: dict(opt.state[p]) for n, p in model.named_parameters()}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, moments


@pytest.mark.parametrize("fused", [False, True])
def test_offloaded_optimizer_state_trains_bitwise_identically(fused, tmp_path):
    ref_losses, ref_state, ref_moments = _train(tmp_path / "plain", False, fused)
    losses, state, moments = _train(tmp_path / "off", True, fused)
    assert losses == ref_losses
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), k
    for n, ref in ref_moments.items():  # the moments came back exactly
        assert ref.keys() == moments[n].keys() and all(torch.equal(ref[k], moments[n][k]) for k in ref), n


def test_a_tier_that_corrupts_one_bit_is_caught(tmp_path, monkeypatch):
    _, ref_state, _ = _train(tmp_path / "plain", False, False)
    read = activation_offload.FileTier._read

    def flip_a_bit(written, nbytes):
        buf = read(written, nbytes)
        buf[3] ^= 0x40  # the exponent of the chunk's first float32 moment
        return buf

    monkeypatch.setattr(activation_offload.FileTier, "_read", staticmethod(flip_a_bit))
    _, state, _ = _train(tmp_path / "off", True, False)
    assert any(not torch.equal(state[k], ref_state[k]) for k in state)


def test_chunks_are_blocks_and_top_level_modules():
    model = Transformer(dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=3))
    chunks = parameter_chunks(model)
    assert len(chunks) == 3 + 3  # 3 blocks, the embedding, the final norm, the output
    assert sum(len(c) for c in chunks) == len(list(model.parameters()))
