"""Cross entropy over chunks of the sequence: no float32 copy of the whole [tokens x vocab] logits, nor of
their gradient, exists at once.

The plain loss upcasts the whole logits to float32, keeps the float32 log-softmax for backward and builds a
float32 gradient before casting it back: at Llama 3's 128k vocabulary those [tokens x vocab] float32 tensors
are the largest allocations of a step. Here the forward computes each chunk's loss (float32 inside the chunk
only) and saves nothing but the logits, which the model produced anyway; the backward recomputes each
chunk's softmax and writes its gradient, in the logits' dtype, into one gradient buffer. The extra cost is
one recomputed log-softmax per token (elementwise work, no matmul).

Exact: each chunk runs the same `chunk_loss` as the unchunked loss, so the sum and the gradient equal the
unchunked ones up to float32 summation order. Works with anything `chunk_loss` accepts: TP's loss parallel
(the logits are a vocabulary-sharded DTensor; the chunks are sequence slices of it), the pipeline's last
stage (it is the schedule's loss function), a compiled `chunk_loss`, and SFT's masked labels (-100).
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a sequence of `seq_len` positions (the last one may be shorter)."""
    return [(s, min(s + chunk_size, seq_len)) for s in range(0, seq_len, chunk_size)]


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_loss: ChunkLoss, chunk_size: int):
        bounds = chunk_bounds(logits.size(1), chunk_size)
        total = sum(chunk_loss(logits[:, s:e], labels[:, s:e]) for s, e in bounds)
        ctx.save_for_backward(logits, labels)
        ctx.chunk_loss, ctx.bounds = chunk_loss, bounds
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, labels = ctx.saved_tensors
        # A plain tensor's chunk gradients go straight into one buffer; a DTensor's (loss parallel) are
        # concatenated, since writing into a slice of a DTensor is not a DTensor operation.
        buffer = None if isinstance(logits, DTensor) else torch.empty_like(logits)
        parts = []
        for s, e in ctx.bounds:
            with torch.enable_grad():
                chunk = logits[:, s:e].detach().requires_grad_()
                (grad,) = torch.autograd.grad(ctx.chunk_loss(chunk, labels[:, s:e]), chunk, grad_total)
            if buffer is None:
                parts.append(grad)
            else:
                buffer[:, s:e].copy_(grad)
            del grad, chunk
        return (buffer if buffer is not None else torch.cat(parts, dim=1)), None, None, None


def chunked_loss(chunk_loss: ChunkLoss, chunk_size: int) -> ChunkLoss:
    """loss(logits [B, S, V], labels [B, S]) = the sum of `chunk_loss` over sequence chunks of `chunk_size`
    positions, computed as described in the module docstring (`chunk_loss` returns a summed token loss)."""

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if chunk_size >= logits.size(1):  # one chunk: the plain loss (e.g. a context-parallel rank's slice)
            return chunk_loss(logits, labels)
        if not torch.is_grad_enabled() or not logits.requires_grad:  # validation: nothing to save
            with torch.no_grad():
                return sum(chunk_loss(logits[:, s:e], labels[:, s:e]) for s, e in chunk_bounds(logits.size(1), chunk_size))
        return _ChunkedLoss.apply(logits, labels, chunk_loss, chunk_size)

    return loss
