"""Llama 3 / 3.1 decoder-only transformer.

Built for being cut up: a pipeline stage deletes layers or sets tok_embeddings / norm / output to None,
and the surviving parameter names stay those of the whole model (layers are keyed by their original
index). Parameters are created on the meta device and materialised with `to_empty` + `init_weights`.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.init import init_decoder_weights, trunc_normal
from torchtitan.models.common.rope import apply_rope_interleaved as apply_rope
from torchtitan.models.common.rope import rope_table
from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingArgs | None) -> torch.Tensor:
    """Rotation frequency of each of the head_dim/2 pairs, in float64 so that angles at positions
    around 1e5 stay accurate to fp32 precision."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is None:
        return freqs
    # Llama 3.1: wavelengths shorter than original_len/high_freq_factor are kept, longer than
    # original_len/low_freq_factor are stretched by `factor`, and the band between is interpolated.
    wavelen = 2 * math.pi / freqs
    old_len = scaling.original_max_position_embeddings
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * freqs / scaling.factor + smooth * freqs
    scaled = torch.where(wavelen > old_len / scaling.low_freq_factor, freqs / scaling.factor, blended)
    return torch.where(wavelen < old_len / scaling.high_freq_factor, freqs, scaled)


def precompute_rope_cache(
    head_dim: int, max_seq_len: int, theta: float, scaling: RopeScalingArgs | None
) -> torch.Tensor:
    """[max_seq_len, head_dim/2, 2] float32 table of (cos, sin) of position * frequency. Real-valued,
    because complex tensors are poorly supported by DTensor and torch.compile."""
    return rope_table(rope_frequencies(head_dim, theta, scaling), max_seq_len)


class Attention(nn.Module):
    def __init__(self, args: TransformerModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.inner_attention = ScaledDotProductAttention()

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.wo.weight, out_std)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # Rows are gathered here, where the sequence is whole again: under sequence parallel the block input
        # is a sequence shard, and the attention input is the all-gathered sequence.
        rope = rope_cache[positions] if positions is not None else rope_cache[:seqlen]
        # Head counts come from the projections' (possibly tensor-parallel-local) widths, hence -1.
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids)
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


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
    def __init__(self, layer_id: int, args: TransformerModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        # Smaller init for the projections writing into the residual stream keeps its variance bounded
        # as layers add up; depth_init scales by this layer's depth, otherwise by the total depth.
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.feed_forward.init_weights(self.out_init_std)

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: torch.Tensor,
        positions: torch.Tensor | None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, document_ids)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    # The modules before and after `layers` (protocols.model.ModelProtocol): a pipeline's first stage holds
    # the embedding, its last the final norm and output.
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: TransformerModelArgs):
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
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling)

    def tie_weights(self) -> None:
        """Makes the output projection use the embedding's Parameter when the args tie them (Llama 3.2 1B/3B).
        `to_empty` and TP's styles replace parameters one by one, so init_weights and the parallelizer tie
        them again."""
        if self.model_args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise whatever parts this (possibly pipeline-split) model holds, from the torch RNG.

        Embedding ~ N(0, 1); wq/wk/wv/w1 ~ N(0, 0.02); wo/w2/w3 ~ N(0, out_init_std) (see TransformerBlock);
        output ~ N(0, dim^-0.5); normals truncated at 3 std. Norm weights are ones. A tied matrix gets the
        output's init.
        """
        init_decoder_weights(self, buffer_device, lambda layer: layer.init_weights())

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens: [B, S] ids, or [B, S, dim] hidden states on a stage without tok_embeddings.
        positions: [S] or [B, S] RoPE positions of the given tokens (context parallel hands each rank a
        non-contiguous slice; packed documents may restart at 0); None = 0..S-1 (or the CP slice's).
        document_ids: [B, S] document of each token; attention then stays within documents.
        Returns logits, or hidden states on a stage without output."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, document_ids)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h

