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
    from torchtitan.distributed.compile import compile_loss, compiles

    return compile_loss(cross_entropy_sum) if compiles(job_config, "loss") else cross_entropy_sum
