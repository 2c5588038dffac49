"""The decoder that Qwen3-MoE and GPT-OSS share: pre-norm blocks of (attention, MoE layer) between an embedding
and a norm + output projection, the MoE layers' balance loss and expert loads gathered over every layer.

A family gives its attention module and its RoPE table; the rest (module names, init order, the forward) is
here. A whole model returns a ModelOutput (logits, the balance loss, per-layer expert load); a pipeline stage
(a model without its embedding or its output) returns plain tensors.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from torchtitan.components.moe import MoE, MoEArgs, MoEOutput
from torchtitan.components.moe.moe import RouterBalance, add_layer_stats
from torchtitan.models.common.init import trunc_normal
from torchtitan.protocols.model import ModelOutput


class MoEBlock(nn.Module):
    """x + attention(norm(x)), then h + moe(norm(h)). `attention(x, rope_cache, positions, *inputs)` takes the
    forward's extra inputs (e.g. document ids) as they come; `init_weights(out_std)` initialises it."""

    def __init__(self, layer_id: int, args, attention: nn.Module):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        moe_args: MoEArgs = args.moe
        self.moe = MoE(args.dim, moe_args)
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.moe.init_weights(self.out_init_std, buffer_device)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None, *inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, MoEOutput]:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, *inputs)
        moe = self.moe(self.ffn_norm(h))
        return h + moe.out, moe


class MoETransformer(nn.Module):
    """The stack. A family subclasses it with its `forward` signature (calling `run`) and its `rope_table`."""

    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args, attention: Callable[[int], nn.Module]):
        """`attention(layer_id)` builds one block's attention module."""
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): MoEBlock(i, args, attention(i)) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, never checkpointed; init_weights recomputes it after to_empty.
        self.register_buffer("rope_cache", self.rope_table(), persistent=False)
        self.fixed_positions: torch.Tensor | None = None  # set by context parallel

    def rope_table(self) -> torch.Tensor:
        raise NotImplementedError

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1); each block's attention and MoE layer as they define (projections ~ N(0, 0.02) or
        the depth-scaled std, the router gate ~ N(0, 0.02), the experts like an FFN); output ~ N(0, dim^-0.5);
        normals truncated at 3 std."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self.rope_table()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            trunc_normal(self.output.weight, self.model_args.dim**-0.5)

    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, *inputs: torch.Tensor | None
    ) -> ModelOutput | torch.Tensor:
        """The forward: `inputs` go to every block's attention after the positions."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}
        balance = RouterBalance()  # transformers' load-balancing loss, over every layer's tokens together
        for key, layer in self.layers.items():
            h, moe = layer(h, self.rope_cache, positions, *inputs)
            aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
            balance.add(moe, layer.moe)
        aux_loss = balance.add_to(aux_loss)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        if self.tok_embeddings is None or self.output is None:
            return out  # a pipeline stage: activations only
        return ModelOutput(logits=out, aux_loss=aux_loss, metrics=metrics)
