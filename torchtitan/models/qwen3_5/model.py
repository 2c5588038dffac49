"""Qwen3.5: a decoder whose token mixer is, layer by layer (`layer_types`), Gated DeltaNet linear attention
or gated softmax attention (models/common/gated_deltanet.py, gated_attention.py); then a SwiGLU (dense) or the
shared MoE layer with a gated shared expert (MoE flavors). Norms are zero-centred RMSNorms (scale 1 + w).

Follows protocols.model.ModelProtocol: blocks in `layers` keyed by their original index, `pipeline_head` /
`pipeline_tail`, built on meta and materialised by `to_empty` + `init_weights`. Either kind of block has its
mixer at `attention` with its sequence kernel at `attention.inner_attention`, so context parallel finds both
and picks ring attention or state passing by the kernel's kind. A whole MoE model returns a ModelOutput
(logits, expert loads); a dense one logits.
"""

import math

import torch
from torch import nn

from torchtitan.components.moe import MoE, MoEOutput
from torchtitan.components.moe.moe import RouterBalance, SwiGLU, add_layer_stats
from torchtitan.models.common.gated_attention import GatedAttention, ZeroCenteredRMSNorm
from torchtitan.models.common.init import init_decoder_weights
from torchtitan.models.common.gated_deltanet import GatedDeltaNet
from torchtitan.models.common.rope import precompute_rope_cache
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs
from torchtitan.protocols.model import ModelOutput


class Block(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3_5ModelArgs):
        super().__init__()
        self.kind = args.layer_kinds[layer_id]
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.attention = GatedDeltaNet(args) if self.kind == "linear_attention" else GatedAttention(args)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        if args.moe is None:
            self.feed_forward = SwiGLU(args.dim, args.hidden_dim)
        else:
            self.moe = MoE(args.dim, args.moe)
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        if hasattr(self, "moe"):
            self.moe.init_weights(self.out_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.out_init_std)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, document_ids)
        if hasattr(self, "moe"):
            moe = self.moe(self.ffn_norm(h))
            return h + moe.out, moe
        return h + self.feed_forward(self.ffn_norm(h)), None


class Qwen3_5(nn.Module):
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: Qwen3_5ModelArgs):
        super().__init__()
        args.check()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm: ZeroCenteredRMSNorm | None = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        self.fixed_positions: torch.Tensor | None = None  # set by context parallel

    def _rope_cache(self) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.rotary_dim, a.max_seq_len, a.rope_theta)

    def tie_weights(self) -> None:
        if self.model_args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1) (a tied one gets the output's init), projections ~ N(0, 0.02) or the
        depth-scaled std, output ~ N(0, dim^-0.5); zero-centred norm weights 0; DeltaNet: A uniform in
        [0.01, 16] (A_log its log), dt_bias 1, conv as PyTorch's Conv1d default, output norm weight 1."""
        init_decoder_weights(self, buffer_device, lambda layer: layer.init_weights(buffer_device))

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        """tokens [B, S] (or hidden states on a stage without the embedding); positions [S] or [B, S] for RoPE;
        document_ids [B, S]: attention stays within documents and the DeltaNet state and conv restart at
        each document start."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}
        balance = RouterBalance()  # transformers' load-balancing loss, over every layer's tokens together
        for key, layer in self.layers.items():
            h, moe = layer(h, self.rope_cache, positions, document_ids)
            if moe is not None:
                aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
                balance.add(moe, layer.moe)
        aux_loss = balance.add_to(aux_loss)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        if self.model_args.moe is None or self.tok_embeddings is None or self.output is None:
            return out
        return ModelOutput(logits=out, aux_loss=aux_loss, metrics=metrics)
