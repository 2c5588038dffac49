"""Weight initialisation shared by the families."""

import torch
from torch import nn


def trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-3 std, in place. nn.init ops work in place on DTensor parameters, so this also
    initialises FSDP/TP shards."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)
