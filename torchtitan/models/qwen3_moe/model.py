"""Qwen3-MoE: Qwen3's attention (models/common/qk_norm_attention.py) and the shared MoE layer in every block.

Follows protocols.model.ModelProtocol like Qwen3. A whole model returns a ModelOutput (logits, the balance
loss, per-layer expert load); a pipeline stage returns plain tensors.
"""

import math

import torch
from torch import nn

from torchtitan.components.moe import MoE, MoEOutput
from torchtitan.components.moe.moe import RouterBalance, add_layer_stats
from torchtitan.models.common.qk_norm_attention import QKNormAttention
from torchtitan.models.common.rope import precompute_rope_cache
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs
from torchtitan.protocols.model import ModelOutput


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3MoeModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = QKNormAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe)
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.moe.init_weights(self.out_init_std, buffer_device)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, MoEOutput]:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions)
        moe = self.moe(self.ffn_norm(h))
        return h + moe.out, moe


class Qwen3Moe(nn.Module):
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: Qwen3MoeModelArgs):
        super().__init__()
        if args.tie_embeddings:
            raise ValueError("Qwen3-MoE flavors have an untied output projection; tie_embeddings must be False")
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.fixed_positions: torch.Tensor | None = None  # set by context parallel

    def _rope_cache(self) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """As Qwen3 (embedding ~ N(0, 1), projections ~ N(0, 0.02) or the depth-scaled std, output ~
        N(0, dim^-0.5)); the router gate ~ N(0, 0.02), the experts like an FFN."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._rope_cache()
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal(self.output.weight, self.model_args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> ModelOutput | torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}
        balance = RouterBalance()  # transformers' load-balancing loss, over every layer's tokens together
        for key, layer in self.layers.items():
            h, moe = layer(h, self.rope_cache, positions)
            aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
            balance.add(moe, layer.moe)
        aux_loss = balance.add_to(aux_loss)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        if self.tok_embeddings is None or self.output is None:
            return out  # a pipeline stage: activations only
        return ModelOutput(logits=out, aux_loss=aux_loss, metrics=metrics)
