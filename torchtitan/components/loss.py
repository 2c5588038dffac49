"""The training loss: summed token cross entropy.

The trainer divides the sum by the number of label tokens in the whole global batch, so gradient
accumulation, data-parallel sharding and context-parallel sequence sharding all leave the loss unchanged.
"""

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


def build_cross_entropy_loss(job_config: JobConfig):
    """The summed token cross entropy, compiled if the job compiles the loss, over sequence chunks of
    `training.loss_chunk_size` positions when that is set (the compiled kernel is then each chunk's)."""
    from torchtitan.components.chunked_loss import chunked_loss
    from torchtitan.distributed.compile import compile_loss, compiles

    loss = compile_loss(cross_entropy_sum) if compiles(job_config, "loss") else cross_entropy_sum
    chunk = job_config.training.loss_chunk_size
    return chunked_loss(loss, chunk) if chunk > 0 else loss


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
    loss of the step, weighted like the training loss."""
    with torch.no_grad():
        out = torch.zeros(2, num_sources, device=labels.device)
        # Over sequence chunks: a float32 copy of the whole logits is what the chunked loss avoids.
        for s in range(0, logits.size(1), _SOURCE_LOSS_CHUNK):
            e = s + _SOURCE_LOSS_CHUNK
            token_loss = F.cross_entropy(
                logits[:, s:e].flatten(0, 1).float(), labels[:, s:e].flatten(0, 1), reduction="none",
                ignore_index=IGNORE_INDEX,
            )
            if isinstance(token_loss, DTensor):  # loss parallel
                token_loss = token_loss.full_tensor()
            ids = source_ids[:, s:e].flatten()
            out[0].index_add_(0, ids, token_loss.float())
            out[1].index_add_(0, ids, (labels[:, s:e].flatten() != IGNORE_INDEX).float())
    return out


_SOURCE_LOSS_CHUNK = 1024  # sequence positions per chunk of the per-source loss (no grad: any size is exact)


def per_source_metrics(sums: torch.Tensor, names: list[str]) -> dict[str, float]:
    """loss/<source> of the sources that had trained tokens in the step."""
    return {f"loss/{n}": (sums[0, i] / sums[1, i]).item() for i, n in enumerate(names) if sums[1, i] > 0}
