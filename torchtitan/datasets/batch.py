"""What the trainer does with a loader batch's `inputs`: a token tensor [B, S], or a dict of [B, S] tensors
{"tokens", "document_ids", "positions", "source_ids"} (see packing.make_sample)."""

import torch

Inputs = torch.Tensor | dict[str, torch.Tensor]


def inputs_to(inputs: Inputs, device: torch.device) -> Inputs:
    if isinstance(inputs, dict):
        return {k: v.to(device) for k, v in inputs.items()}
    return inputs.to(device)


def pop_source_ids(inputs: Inputs) -> tuple[Inputs, torch.Tensor | None]:
    """(what the model takes, per-token source index or None): source ids only feed the per-source loss."""
    if not isinstance(inputs, dict) or "source_ids" not in inputs:
        return inputs, None
    rest = dict(inputs)
    return rest, rest.pop("source_ids")


def tokens_and_kwargs(inputs: Inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(tokens, keyword arguments of the model's forward), e.g. for a pipeline schedule's step()."""
    if not isinstance(inputs, dict):
        return inputs, {}
    return inputs["tokens"], {k: v for k, v in inputs.items() if k != "tokens"}
