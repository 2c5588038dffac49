"""The decoder that Qwen3-MoE, GPT-OSS and DeepSeek-V3 share: pre-norm blocks of (attention, MoE layer) between
an embedding and a norm + output projection, the MoE layers' balance loss and expert loads gathered over every
layer.

A family gives its attention module and its RoPE table, and where it has them dense blocks (a feed-forward
instead of the MoE layer: DeepSeek-V3's first layers) and multi-token prediction depths (models/common/mtp.py);
the rest (module names, init order, the forward) is here. A whole model returns a ModelOutput (logits, the
balance loss, per-layer expert load, MTP logits in training); a pipeline stage (a model without its embedding
or its output) returns plain tensors.

Multi-token prediction (`mtp_depth` > 0): D more blocks after the output, numbered after the main layers
(DeepSeek-V3's checkpoints: model.layers.{n_layers + k - 1}). In training a whole model adds their logits to
its ModelOutput; under pipeline parallel the MTP module sits on the last stage (a tail module), every earlier
stage passes the input tokens' embeddings on beside the hidden state (so the one shared embedding gets the
MTP's gradient through the pipeline), and the last stage returns (logits, *mtp_logits). In eval mode
(validation, generation) the model computes the main logits only.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from torchtitan.components.moe import MoE, MoEArgs, MoEOutput
from torchtitan.components.moe.moe import RouterBalance, add_layer_stats
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.mtp import MultiTokenPrediction
from torchtitan.protocols.model import ModelOutput


class MoEBlock(nn.Module):
    """x + attention(norm(x)), then h + moe(norm(h)), or in a dense block h + feed_forward(norm(h)).
    `attention(x, rope_cache, positions, *inputs)` takes the forward's extra inputs (e.g. document ids) as they
    come; `init_weights(out_std)` initialises it and a dense block's `feed_forward`."""

    def __init__(self, layer_id: int, args, attention: nn.Module, feed_forward: nn.Module | None = None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = feed_forward is None
        if self.moe_enabled:
            moe_args: MoEArgs = args.moe
            self.moe = MoE(args.dim, moe_args)
        else:
            self.feed_forward = feed_forward
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.out_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.out_init_std)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None, *inputs: torch.Tensor | None
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        """(output, the MoE layer's output for its losses and load; None in a dense block)."""
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, *inputs)
        if not self.moe_enabled:
            return h + self.feed_forward(self.ffn_norm(h)), None
        moe = self.moe(self.ffn_norm(h))
        return h + moe.out, moe


class MoETransformer(nn.Module):
    """The stack. A family subclasses it with its `forward` signature (calling `run`) and its `rope_table`."""

    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(
        self, args, attention: Callable[[int], nn.Module],
        feed_forward: Callable[[int], nn.Module | None] = lambda layer_id: None,
        mtp_depth: int = 0, mtp_loss_weight: float = 0.0,
    ):
        """`attention(layer_id)` builds one block's attention module; `feed_forward(layer_id)` a dense block's
        feed-forward, None for a MoE block; `mtp_depth` multi-token prediction blocks (built like the layers,
        numbered after them) trained with weight `mtp_loss_weight` (the module docstring)."""
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self._block(i, attention, feed_forward) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, never checkpointed; init_weights recomputes it after to_empty.
        self.register_buffer("rope_cache", self.rope_table(), persistent=False)
        self.mtp: MultiTokenPrediction | None = None
        if mtp_depth:
            blocks = [self._block(args.n_layers + k, attention, feed_forward) for k in range(mtp_depth)]
            self.mtp = MultiTokenPrediction(args.dim, args.norm_eps, blocks)
            self.pipeline_tail = (*self.pipeline_tail, "mtp")  # held by the last stage, with the output
        self.mtp_depth, self.mtp_loss_weight = mtp_depth, mtp_loss_weight  # protocols.model.mtp_settings
        self.fixed_positions: torch.Tensor | None = None  # set by context parallel

    def _block(self, layer_id: int, attention, feed_forward) -> MoEBlock:
        # attention before feed_forward: the construction order (and any RNG it draws) stays the families'.
        return MoEBlock(layer_id, self.model_args, attention(layer_id), feed_forward(layer_id))

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
        if self.mtp is not None:  # last: the main weights draw the same numbers with or without MTP
            self.mtp.init_weights(lambda block: block.init_weights(buffer_device))

    def run(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, *inputs: torch.Tensor | None,
        mtp_embeddings: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor | tuple[torch.Tensor, ...]:
        """The forward: `inputs` go to every block's attention after the positions; `mtp_embeddings`: the
        input tokens' embeddings a later pipeline stage receives for multi-token prediction."""
        mtp = self.mtp_depth > 0 and self.training  # not self.mtp: a stage before the last holds no MTP module
        if self.tok_embeddings is not None:
            h = mtp_embeddings = self.tok_embeddings(tokens)
        else:
            h = tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}
        balance = RouterBalance()  # transformers' load-balancing loss, over every layer's tokens together

        def run_block(key: str, layer: MoEBlock, x: torch.Tensor) -> tuple[torch.Tensor, MoEOutput | None]:
            nonlocal aux_loss
            x, moe = layer(x, self.rope_cache, positions, *inputs)
            if moe is not None:
                aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
            return x, moe

        for key, layer in self.layers.items():
            h, moe = run_block(key, layer, h)
            if moe is not None:
                balance.add(moe, layer.moe)
        aux_loss = balance.add_to(aux_loss)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:  # a stage before the last: activations only
            return (h, mtp_embeddings) if mtp else h
        logits = self.output(h)
        mtp_logits = []
        if mtp:  # depth k's block is layer n_layers + k - 1 in the metrics, as in HF checkpoints
            n = self.model_args.n_layers
            mtp_logits = self.mtp(h, mtp_embeddings, self.output, lambda k, b, x: run_block(str(n + k - 1), b, x)[0])
        if self.tok_embeddings is None:
            return (logits, *mtp_logits) if mtp else logits  # a last pipeline stage
        return ModelOutput(logits=logits, aux_loss=aux_loss, metrics=metrics, mtp_logits=mtp_logits)
