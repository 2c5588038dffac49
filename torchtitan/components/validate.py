"""Validation: the loss of the model on held-out batches, as a token mean over every data-parallel rank.

The default validator of a TrainSpec (`build_validator_fn`). A model with other needs (extra metrics, a
benchmark) gives its spec a builder of its own with the same shape:

    validate(forward_loss_sum, batches, reduce_sum) -> {metric name: float}

`forward_loss_sum(inputs, labels)` runs the model without gradients however the job is laid out (plain,
pipelined, context parallel) and returns the summed token loss of the batch; `reduce_sum(tensor)` sums a
tensor over the ranks that saw different data.
"""

import math
from collections.abc import Callable, Iterable

import torch

from torchtitan.components.loss import IGNORE_INDEX


def build_validator(job_config) -> Callable:
    max_steps = job_config.validation.steps

    def validate(forward_loss_sum: Callable, batches: Iterable, reduce_sum: Callable) -> dict[str, float]:
        loss_sum, tokens = None, None
        for i, (inputs, labels) in enumerate(batches):
            if 0 <= max_steps <= i:
                break
            batch_loss = forward_loss_sum(inputs, labels)
            batch_tokens = (labels != IGNORE_INDEX).sum().to(batch_loss)
            loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
            tokens = batch_tokens if tokens is None else tokens + batch_tokens
        if loss_sum is None:
            raise ValueError("the validation data yielded no batch; check --validation settings and the dataset")
        loss = (reduce_sum(loss_sum) / reduce_sum(tokens).clamp_min(1)).item()
        return {"validation/loss": loss, "validation/perplexity": math.exp(min(loss, 50.0))}

    return validate
