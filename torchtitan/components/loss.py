"""The training loss: summed token cross entropy, optionally over chunks of the sequence.

The trainer divides the sum by the number of label tokens in the whole global batch, so gradient
accumulation, data-parallel sharding and context-parallel sequence sharding all leave the loss unchanged.

Chunked (`training.loss_chunk_size`; by default where `auto_chunks` says it pays): no float32 copy of the
whole [tokens x vocab] logits, nor of their gradient, exists at once. The plain loss upcasts the whole logits to float32, keeps the float32 log-softmax
for backward and builds a float32 gradient before casting it back: at Llama 3's 128k vocabulary those
tensors are the largest allocations of a step. Chunked, each chunk's float32 work happens inside the chunk
only, and the gradient is written, chunk by chunk, in the logits' dtype into one buffer. Two ways to get a
chunk's gradient:
- plain tensors and the plain loss: the cross entropy written out; backward computes softmax - one-hot
  from the chunk's logits (one fused softmax). No more passes over the logits than the unchunked loss
  makes (it zero-fills a [tokens x vocab] one-hot gradient and reads the saved log-softmax instead).
- a DTensor (TP's loss parallel: the logits are sharded over the vocabulary) or a compiled loss: backward
  recomputes the chunk's `chunk_loss` and differentiates it, one extra log-softmax per token.
Exact: the sum and the gradient equal the unchunked ones up to float32 rounding (tests/unit/
test_chunked_loss.py: 1e-6). Works under TP's loss parallel (the chunks are sequence slices of the sharded
logits), on the pipeline's last stage (it is the schedule's loss function), with a compiled loss, and with
SFT's masked labels (-100).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan.config.job_config import JobConfig

IGNORE_INDEX = -100


def loss_value(loss: torch.Tensor) -> torch.Tensor:
    """A detached plain tensor of a loss (under loss parallel the loss is a replicated DTensor)."""
    loss = loss.detach()
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # fp32 for the softmax whatever the compute dtype: bf16 logsumexp over a large vocabulary loses bits.
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum", ignore_index=IGNORE_INDEX
    )


ChunkLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mtp_labels(labels: torch.Tensor, k: int) -> torch.Tensor:
    """The targets of multi-token prediction depth k: position i's is the label k positions later
    (t_{i+k+1}); the last k positions have none (IGNORE_INDEX)."""
    if k == 0:
        return labels
    pad = labels.new_full((labels.shape[0], min(k, labels.shape[1])), IGNORE_INDEX)
    return torch.cat((labels[:, k:], pad), dim=1)


def token_and_mtp_loss(
    loss_fn: Callable, logits: torch.Tensor, mtp_logits, labels: torch.Tensor, mtp_weight: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the summed token loss plus mtp_weight / D * the sum over depths of each depth's summed token loss,
    [2, D] float32 per-depth summed losses and trained-token counts (detached; None without depths)).

    `mtp_logits` are the logits of multi-token prediction depths 1..D (models/common/mtp.py), trained on
    the labels shifted by k (`mtp_labels`) with the same loss function as the main logits. Divided by the
    main loss's token count T like the rest, this is DeepSeek-V3's lambda/D * sum_k L^k_MTP with
    L^k_MTP = -1/T sum_i log P^k_i."""
    total = loss_fn(logits, labels)
    if not mtp_logits:
        return total, None
    sums = torch.zeros(2, len(mtp_logits), device=labels.device)
    depth_losses = []
    for k, depth_logits in enumerate(mtp_logits, start=1):
        target = mtp_labels(labels, k)
        depth_losses.append(loss_fn(depth_logits, target))
        sums[0, k - 1] = loss_value(depth_losses[-1]).float()
        sums[1, k - 1] = (target != IGNORE_INDEX).sum()
    return total + mtp_weight / len(mtp_logits) * sum(depth_losses), sums


def mtp_metrics(sums: torch.Tensor) -> dict[str, float]:
    """loss/mtp_k: depth k's mean token loss over its trained tokens (sums as token_and_mtp_loss returns,
    summed over microbatches and ranks)."""
    return {f"loss/mtp_{k}": (sums[0, k - 1] / sums[1, k - 1].clamp_min(1)).item() for k in range(1, sums.shape[1] + 1)}


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


AUTO_CHUNK = 512
"""Sequence positions per chunk of the default (auto) chunked loss: the size the whole-step measurements in
docs/performance.md ("Chunked cross entropy", "MFU at a 1B-shaped Llama slice") used."""
AUTO_MIN_VOCAB = 32768
"""The smallest (local) vocabulary the default chunks: below it the logits are a small share of a step."""
AUTO_MIN_POSITIONS = 2048
"""The shortest sequence (positions of one rank's logits) the default chunks: at 1024 positions of a 128k
vocabulary chunking was measured even with the plain loss (0.96-0.99x a step), at 2048 faster."""


def auto_chunks(local_vocab: int, positions: int, compiled: bool, loss_parallel: bool) -> bool:
    """Whether the default (`training.loss_chunk_size -1`) chunks: where it was measured never slower, i.e.
    the eager loss on plain logits (the direct chunk gradient, no recomputation) of a large vocabulary
    and a long sequence (docs/performance.md). Under TP's loss parallel and with a compiled loss each
    chunk's backward recomputes its log-softmax, so there the default stays the plain loss (set a size to
    chunk anyway)."""
    return (not compiled and not loss_parallel and local_vocab >= AUTO_MIN_VOCAB
            and positions >= AUTO_MIN_POSITIONS)


def _auto_chunked(loss: ChunkLoss) -> ChunkLoss:
    """The plain loss, chunked by AUTO_CHUNK positions where `auto_chunks` holds for the logits it gets."""
    chunked = chunked_loss(loss, AUTO_CHUNK)

    def auto(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if auto_chunks(logits.size(-1), logits.size(1), False, isinstance(logits, DTensor)):
            return chunked(logits, labels)
        return loss(logits, labels)

    return auto


def build_cross_entropy_loss(job_config: JobConfig):
    """The summed token cross entropy, compiled if the job compiles the loss, over sequence chunks of
    `training.loss_chunk_size` positions (the compiled kernel is then each chunk's); -1, the default, chunks
    where `auto_chunks` says it pays, and training.seq_len is one chunk (the plain loss)."""
    from torchtitan.distributed.compile import compile_loss, compiles

    compiled = compiles(job_config, "loss")
    loss = compile_loss(cross_entropy_sum, job_config.compile.backend) if compiled else cross_entropy_sum
    chunk = job_config.training.loss_chunk_size
    if chunk == -1:
        return loss if compiled else _auto_chunked(loss)
    return chunked_loss(loss, chunk)


def pop_source_ids(inputs):
    """(what the model takes, per-token source index [B, S] or None): a mixture's loader adds
    "source_ids" to the inputs dict for the per-source loss; the model never sees it."""
    if not isinstance(inputs, dict) or "source_ids" not in inputs:
        return inputs, None
    rest = dict(inputs)
    return rest, rest.pop("source_ids")


def per_source_loss_sums(
    logits: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor, num_sources: int
) -> torch.Tensor:
    """[2, num_sources] fp32: the summed token loss and the trained-token count of each source (no grad).

    Summed over data- and context-parallel ranks, loss/<source> = row 0 / row 1 is each source's mean token
    loss of the step, weighted like the training loss.

    labels and source_ids are [B, S], or [B, S, K]: K (label, source) slots per position, for an evaluation
    row that several requests read (torchtitan/eval/scoring.py: requests whose inputs are one row's prefixes
    predict other tokens, or the same ones for other requests, at the same positions); a slot's loss is the
    position's cross entropy at its label, IGNORE_INDEX slots add nothing."""
    if labels.dim() == 2:
        labels, source_ids = labels.unsqueeze(-1), source_ids.unsqueeze(-1)
    with torch.no_grad():
        out = torch.zeros(2, num_sources, device=labels.device)
        # Over sequence chunks: a float32 copy of the whole logits is what the chunked loss avoids.
        for s in range(0, logits.size(1), _SOURCE_LOSS_CHUNK):
            e = s + _SOURCE_LOSS_CHUNK
            chunk = logits[:, s:e].flatten(0, 1).float()
            for k in range(labels.size(-1)):
                slot = labels[:, s:e, k].flatten()
                token_loss = F.cross_entropy(chunk, slot, reduction="none", ignore_index=IGNORE_INDEX)
                if isinstance(token_loss, DTensor):  # loss parallel
                    token_loss = token_loss.full_tensor()
                ids = source_ids[:, s:e, k].flatten()
                out[0].index_add_(0, ids, token_loss.float())
                out[1].index_add_(0, ids, (slot != IGNORE_INDEX).float())
    return out


def first_label_slot(labels: torch.Tensor) -> torch.Tensor:
    """[B, S] labels for the token loss of a batch whose labels may carry K slots per position ([B, S, K],
    see per_source_loss_sums): the first slot."""
    return labels[..., 0] if labels.dim() == 3 else labels


_SOURCE_LOSS_CHUNK = 1024  # sequence positions per chunk of the per-source loss (no grad: any size is exact)


def per_source_metrics(sums: torch.Tensor, names: list[str]) -> dict[str, float]:
    """loss/<source> of the sources that had trained tokens in the step."""
    return {f"loss/{n}": (sums[0, i] / sums[1, i]).item() for i, n in enumerate(names) if sums[1, i] > 0}
