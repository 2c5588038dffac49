"""The one random batch the unit tests' tiny training loops train on: 2 sequences of 64 tokens from a 2,048-token
vocabulary, drawn from the caller's generator, and its mean next-token loss."""

import torch

from torchtitan.components.loss import cross_entropy_sum


def random_batch_loss(model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
    tokens = torch.randint(0, 2048, (2, 65), generator=gen)
    return cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
