"""Qwen3 (dense) decoder-only transformer.

What differs from Llama 3: q and k are RMS-normalised over each head's vector (QK-norm) before RoPE; the head
size is a field of its own, not dim / n_heads; the small sizes tie the output projection to the embedding;
RoPE rotates the two halves of each head (the "rotate_half" layout of the Hugging Face checkpoints, so the
adapter renames weights without permuting rows).

Follows protocols.model.ModelProtocol: blocks in `layers` keyed by their original index, `pipeline_head` /
`pipeline_tail` name the modules around them (a pipeline stage sets those it lacks to None), built on meta,
materialised by `to_empty` + `init_weights`.

Tied embeddings: `output.weight` IS `tok_embeddings.weight` (one Parameter, so one gradient and one optimizer
state). `to_empty` replaces each module's parameters one by one and so unties them; `init_weights` ties them
again, which is why the protocol's to_empty + init_weights order matters here.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.qk_norm_attention import QKNormAttention
from torchtitan.models.common.rope import precompute_rope_cache
from torchtitan.models.common.qwen3_args import Qwen3ModelArgs


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, out_std: float) -> None:
        trunc_normal(self.w1.weight, 0.02)
        trunc_normal(self.w2.weight, out_std)
        trunc_normal(self.w3.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = QKNormAttention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        # Smaller init for the projections writing into the residual stream keeps its variance bounded as
        # layers add up; depth_init scales by this layer's depth, otherwise by the total depth.
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.feed_forward.init_weights(self.out_init_std)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3(nn.Module):
    # The modules before and after `layers` (protocols.model.ModelProtocol): a pipeline's first stage holds the
    # embedding, its last the final norm and output. The generic appliers (FSDP, compile) know these names.
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: Qwen3ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        # Non-persistent: derived from args, so never checkpointed; init_weights recomputes it after to_empty.
        self.register_buffer("rope_cache", self._rope_cache(), persistent=False)
        # True positions of the tokens this rank holds when they are not 0..S-1 for every batch, e.g. the
        # load-balanced slice of context parallel; set by the parallelizer, used when forward gets none.
        self.fixed_positions: torch.Tensor | None = None

    def _rope_cache(self) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    def tie_weights(self) -> None:
        """Makes the output projection use the embedding's Parameter, when the args tie them. Both are
        [vocab, dim]; the parallelizer calls this again after it replaces parameters (TP)."""
        if self.model_args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise whatever parts this (possibly pipeline-split) model holds, from the torch RNG.

        Embedding ~ N(0, 1); wq/wk/wv/w1 ~ N(0, 0.02); wo/w2/w3 ~ N(0, out_init_std) (see TransformerBlock);
        output ~ N(0, dim^-0.5); normals truncated at 3 std. Norm weights (also QK-norm) are ones. A tied matrix
        gets the output's init: it sets the scale of the first logits, while the embedding side is normalised
        by the first block's RMSNorm anyway.
        """
        self.tie_weights()  # to_empty untied them (see the module docstring)
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = self._rope_cache()
        if self.tok_embeddings is not None and not self.model_args.tie_embeddings:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            trunc_normal(self.output.weight, self.model_args.dim**-0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: [B, S] ids, or [B, S, dim] hidden states on a stage without tok_embeddings.
        positions: [S] or [B, S] true positions of the given tokens (context parallel hands each rank a
        non-contiguous slice); None = 0..S-1. Returns logits, or hidden states on a stage without output."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
