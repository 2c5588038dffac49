"""Sliding windows, sinks and documents on CPU with SDPA's own flash kernel, block by block.

The shared kernel's exact blockwise path (attention.blockwise_attention) does its block math in plain torch
and float32. On CPU the same loop can call the fused flash-attention kernel torch ships for SDPA
(`aten._scaled_dot_product_flash_attention_for_cpu`) on each (query block, key span) pair: it runs in the
inputs' dtype (bf16 natively on AVX-512-BF16), reads grouped kv heads in place, takes an additive mask for the
partially visible spans and returns the block's log-sum-exp. The sinks are folded into that log-sum-exp once
(out' = out * sigmoid(lse - sink)), and the backward is the flash kernel's own backward given the final
(out', lse'): a sink adds a zero-valued column to every row's softmax, so the gradients of q, k and v are
those of the kernel with the sink-inclusive normaliser, and the sinks' own gradient is `sink_grad`.

Saved for backward: q, k, v (as given, kv heads not repeated), the output and the fp32 log-sum-exp, as the
plain-torch path saves; masks are rebuilt in backward. Measured per case in docs/performance.md
(`scripts/benchmarks/bench_attention.py`); the shared kernel picks it on CPU in eager mode.
"""

import torch

from torchtitan.distributed.context_parallel import fold_sinks_, sink_grad, window_block_state, window_causal_mask

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _additive_mask(q0: int, q1: int, k0: int, window: int | None, document_ids: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor | None:
    """[B or 1, 1, q1-q0, q1-k0] additive mask (0 visible, -inf not) of a span, None when all is visible.
    The flash kernel takes masks of the query's dtype only."""
    visible = None
    if window_block_state(q0, k0, q1 - q0, q1 - k0, window) != "full":
        visible = window_causal_mask(torch.arange(q0, q1), torch.arange(k0, q1), window)[None, None]
    if document_ids is not None:
        same = (document_ids[:, q0:q1].unsqueeze(-1) == document_ids[:, k0:q1].unsqueeze(-2))[:, None]
        visible = same if visible is None else same & visible
    if visible is None:
        return None
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


class FlashBlockAttention(torch.autograd.Function):
    """q [B, Hq, S, D], k/v [B, Hkv, S, D] on CPU; spans [(q0, q1, k0)] as attention._spans gives them."""

    @staticmethod
    def forward(ctx, q, k, v, document_ids, window, sinks, spans):  # type: ignore[override]
        batch, hq, seq, dim = q.shape
        scale = dim**-0.5
        out = torch.empty_like(q)
        lse = torch.empty(batch, hq, seq, dtype=torch.float32)
        for q0, q1, k0 in spans:
            mask = _additive_mask(q0, q1, k0, window, document_ids, q.dtype)
            o, l = _flash(q[:, :, q0:q1], k[:, :, k0:q1], v[:, :, k0:q1], 0.0, False, attn_mask=mask, scale=scale)
            out[:, :, q0:q1], lse[:, :, q0:q1] = o, l
        if sinks is not None:
            # fold_sinks_ works in the 5-D GQA layout [B, Hkv, G, S(, D)]; one group of all heads is the same.
            out32 = out.float().unsqueeze(1)
            lse = fold_sinks_(out32, lse.unsqueeze(1), sinks).squeeze(1)
            out = out32.squeeze(1).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks, document_ids)
        ctx.window, ctx.spans = window, spans
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, sinks, document_ids = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        dout = dout.contiguous()
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32)  # spans overlap: accumulate in fp32
        dv = torch.zeros(v.shape, dtype=torch.float32)
        for q0, q1, k0 in ctx.spans:
            mask = _additive_mask(q0, q1, k0, ctx.window, document_ids, q.dtype)
            lse_blk = lse[:, :, q0:q1].transpose(1, 2).contiguous().transpose(1, 2)  # the kernel's [B, S, H] layout
            gq, gk, gv = _flash_backward(dout[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:q1], v[:, :, k0:q1],
                                         out[:, :, q0:q1], lse_blk, 0.0, False, attn_mask=mask, scale=scale)
            dq[:, :, q0:q1] = gq
            dk[:, :, k0:q1] += gk
            dv[:, :, k0:q1] += gv
        dsinks = None
        if sinks is not None:
            delta = (dout.float() * out.float()).sum(-1)
            dsinks = sink_grad(lse.unsqueeze(1), delta.unsqueeze(1), sinks)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks, None
