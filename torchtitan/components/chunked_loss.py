"""Cross entropy over chunks of the sequence: no float32 copy of the whole [tokens x vocab] logits, nor of
their gradient, exists at once.

The plain loss upcasts the whole logits to float32, keeps the float32 log-softmax for backward and builds a
float32 gradient before casting it back: at Llama 3's 128k vocabulary those [tokens x vocab] float32 tensors
are the largest allocations of a step. Here each chunk's float32 work happens inside the chunk only, and the gradient is written, chunk by chunk,
in the logits' dtype into one buffer. Two ways to get a chunk's gradient:
- plain tensors and the plain loss: the cross entropy written out; backward computes softmax - one-hot
  from the chunk's logits (one fused softmax). No more passes over the logits than the unchunked loss
  makes (it zero-fills a [tokens x vocab] one-hot gradient and reads the saved log-softmax instead).
- a DTensor (TP's loss parallel: the logits are sharded over the vocabulary) or a compiled loss: backward
  recomputes the chunk's `chunk_loss` and differentiates it, one extra log-softmax per token.

Exact: the sum and the gradient equal the unchunked ones up to float32 rounding (tests/unit/
test_chunked_loss.py: 1e-6). Works under TP's loss parallel (the chunks are sequence slices of the sharded logits),
on the pipeline's last stage (it is the schedule's loss function), with a compiled `chunk_loss`, and with
SFT's masked labels (-100).
"""

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from torchtitan.components.loss import IGNORE_INDEX, cross_entropy_sum

ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def chunk_bounds(seq_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a sequence of `seq_len` positions (the last one may be shorter)."""
    return [(s, min(s + chunk_size, seq_len)) for s in range(0, seq_len, chunk_size)]


def _direct_chunk(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed token loss of a chunk, the cross entropy written out (-log p of each trained target)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -torch.where(labels != IGNORE_INDEX, target, 0.0).sum()


def _direct_chunk_grad(logits: torch.Tensor, labels: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """d(summed token loss)/d(logits) of a chunk times grad_total: (softmax - one-hot) on trained tokens."""
    grad = torch.softmax(logits.float(), dim=-1)
    grad.scatter_add_(-1, labels.clamp(min=0).unsqueeze(-1), grad.new_full((*labels.shape, 1), -1.0))
    return grad.mul_((labels != IGNORE_INDEX).unsqueeze(-1) * grad_total).to(logits.dtype)


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_loss: ChunkLoss | None, chunk_size: int):
        bounds = chunk_bounds(logits.size(1), chunk_size)
        ctx.chunk_loss, ctx.bounds = chunk_loss, bounds
        ctx.save_for_backward(logits, labels)
        return sum((chunk_loss or _direct_chunk)(logits[:, s:e], labels[:, s:e]) for s, e in bounds)

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        logits, labels = ctx.saved_tensors
        # A plain tensor's chunk gradients go straight into one buffer; a DTensor's (loss parallel) are
        # concatenated, since writing into a slice of a DTensor is not a DTensor operation.
        buffer = None if isinstance(logits, DTensor) else torch.empty_like(logits)
        parts = []
        for s, e in ctx.bounds:
            if ctx.chunk_loss is None:
                grad = _direct_chunk_grad(logits[:, s:e], labels[:, s:e], grad_total)
            else:  # recompute the chunk's loss and differentiate it (DTensor ops, a compiled loss)
                with torch.enable_grad():
                    chunk = logits[:, s:e].detach().requires_grad_()
                    (grad,) = torch.autograd.grad(ctx.chunk_loss(chunk, labels[:, s:e]), chunk, grad_total)
            if buffer is None:
                parts.append(grad)
            else:
                buffer[:, s:e].copy_(grad)
            del grad
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
        direct = chunk_loss is cross_entropy_sum and not isinstance(logits, DTensor)
        return _ChunkedLoss.apply(logits, labels, None if direct else chunk_loss, chunk_size)

    return loss
