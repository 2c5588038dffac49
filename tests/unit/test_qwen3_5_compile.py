"""Qwen3.5 blocks compile whole (fullgraph, as distributed/compile.py compiles every block): a linear-attention
block (conv, chunked delta rule with its chunk loop, document resets on a ragged last chunk) and a gated
full-attention block, both with the MoE feed-forward and its gated shared expert (the dense feed-forward is
components/moe's SwiGLU, compiled in every other family's tests).

The test traces with dynamo and AOTAutograd (backend aot_eager: graph breaks, data-dependent control flow and
the backward partition are what can break) and compares loss and gradients with eager. Inductor's code
generation on top costs ~15 minutes on the shared 2-core CI machine (measured: 941 s for this model at load 22),
so it was run once instead, with `backend="inductor"` here: loss within 1e-5 relative and every gradient within
1e-4 of its tensor's largest entry held (float32, AMD EPYC, torch 2.13; the dense tiny model measured loss
identical, gradients 1.0e-5)."""

import copy

import torch

from torchtitan.components.loss import cross_entropy_sum
from torchtitan.models.qwen3_5 import Qwen3_5, qwen3_5_flavors

BACKEND = "aot_eager"


def _loss_and_grads(model, tokens, document_ids):
    out = model(tokens, document_ids=document_ids)
    loss = cross_entropy_sum(out.logits, tokens) / tokens.numel()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_linear_and_full_attention_moe_blocks_compile_and_match_eager():
    args = qwen3_5_flavors["debugmodel_tiny_moe"]
    assert args.layer_kinds == ("linear_attention", "full_attention")
    torch.manual_seed(0)
    eager = Qwen3_5(args)
    eager.init_weights()
    compiled = copy.deepcopy(eager)
    for block in compiled.layers.values():
        block.compile(fullgraph=True, backend=BACKEND)
    tokens = torch.randint(0, args.vocab_size, (2, 40))  # 40 tokens: chunks of 16, the last one ragged
    document_ids = torch.tensor([[0] * 13 + [1] * 27, [0] * 40])
    loss_e, grads_e = _loss_and_grads(eager, tokens, document_ids)
    loss_c, grads_c = _loss_and_grads(compiled, tokens, document_ids)
    assert abs(loss_c - loss_e) <= 1e-5 * abs(loss_e)
    for name, g in grads_e.items():
        err = (grads_c[name] - g).abs().max() / g.abs().max().clamp_min(1e-12)
        assert err <= 1e-4, f"{name}: {err:.2e}"
