"""Weight initialisation shared by the families: the truncated normal every projection uses, and the order in
which a whole decoder (Llama 3, Qwen3.5) initialises what it holds (a pipeline stage may hold only some of it).
One order matters: the torch RNG is consumed in it, so two families that share it draw the same numbers for the
same shapes."""

from collections.abc import Callable

import torch
from torch import nn


def trunc_normal(weight: torch.Tensor, std: float) -> None:
    """Normal(0, std) truncated at +-3 std, in place. nn.init ops work in place on DTensor parameters, so this also
    initialises FSDP/TP shards."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def init_decoder_weights(model: nn.Module, buffer_device: torch.device | None,
                         init_layer: Callable[[nn.Module], None]) -> None:
    """Ties the output to the embedding (when the args say so), rebuilds the RoPE table on `buffer_device`,
    then initialises: embedding ~ N(0, 1) (a tied one gets the output's init), each block by `init_layer`,
    the final norm, output ~ N(0, dim^-0.5) truncated. `model` has tok_embeddings / layers / norm / output
    (any of them None on a pipeline stage), model_args, tie_weights() and _rope_cache()."""
    model.tie_weights()
    with torch.device(buffer_device or model.rope_cache.device):
        model.rope_cache = model._rope_cache()
    if model.tok_embeddings is not None and not model.model_args.tie_embeddings:
        nn.init.normal_(model.tok_embeddings.weight)
    for layer in model.layers.values():
        init_layer(layer)
    if model.norm is not None:
        model.norm.reset_parameters()
    if model.output is not None:
        trunc_normal(model.output.weight, model.model_args.dim**-0.5)
