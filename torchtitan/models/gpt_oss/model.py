"""GPT-OSS: grouped-query attention with biases and a learned sink per head, layers alternating a sliding
window and full attention (attention kinds of the shared kernel, models/common/attention.py), YaRN RoPE in
the half layout, and the shared MoE layer with a biased router and clamped-SwiGLU experts with biases.

Follows protocols.model.ModelProtocol like Qwen3-MoE: a whole model returns a ModelOutput (logits, the balance
loss, per-layer expert load); a pipeline stage returns plain tensors.
"""

import math

import torch
from torch import nn

from torchtitan.components.moe import MoE, MoEOutput
from torchtitan.components.moe.moe import RouterBalance, add_layer_stats
from torchtitan.models.common.attention import AttentionSinks, ScaledDotProductAttention
from torchtitan.models.common.rope import apply_rope_half, rope_table, yarn_frequencies
from torchtitan.models.gpt_oss.args import SLIDING, GptOssModelArgs
from torchtitan.protocols.model import ModelOutput


def _trunc_normal(weight: torch.Tensor, std: float) -> None:
    # nn.init ops work in place on DTensor parameters, so this also initialises FSDP/TP shards.
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def yarn_rope_cache(args: GptOssModelArgs) -> torch.Tensor:
    """[max_seq_len, head_dim/2, 2] (cos, sin) table with YaRN frequencies, scaled by its attention factor."""
    freqs, attention_factor = yarn_frequencies(
        args.head_dim, args.rope_theta, args.rope_factor, args.rope_original_seq_len, args.rope_beta_fast,
        args.rope_beta_slow, args.rope_truncate,
    )
    return rope_table(freqs, args.max_seq_len) * attention_factor


class Attention(nn.Module):
    def __init__(self, args: GptOssModelArgs, sliding: bool):
        super().__init__()
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=True)
        self.sinks = AttentionSinks(args.n_heads)
        self.inner_attention = ScaledDotProductAttention(window=args.sliding_window if sliding else None)

    def init_weights(self, out_std: float) -> None:
        for w in (self.wq, self.wk, self.wv):
            _trunc_normal(w.weight, 0.02)
        _trunc_normal(self.wo.weight, out_std)
        for w in (self.wq, self.wk, self.wv, self.wo):
            nn.init.zeros_(w.bias)
        self.sinks.init_weights()

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        rope = rope_cache[positions] if positions is not None else rope_cache[:seqlen]
        # Head counts come from the projections' (possibly tensor-parallel-local) widths, hence -1.
        q = apply_rope_half(self.wq(x).view(bs, seqlen, -1, self.head_dim), rope)
        k = apply_rope_half(self.wk(x).view(bs, seqlen, -1, self.head_dim), rope)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), document_ids,
                                   sinks=self.sinks())
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class Block(nn.Module):
    def __init__(self, layer_id: int, args: GptOssModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, sliding=args.layer_type(layer_id) == SLIDING)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(args.dim, args.moe)
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1 if args.depth_init else args.n_layers))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        self.moe.init_weights(self.out_init_std, buffer_device)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None,
        document_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, MoEOutput]:
        h = x + self.attention(self.attention_norm(x), rope_cache, positions, document_ids)
        moe = self.moe(self.ffn_norm(h))
        return h + moe.out, moe


class GptOss(nn.Module):
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: GptOssModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Non-persistent: derived from args, never checkpointed; init_weights recomputes it after to_empty.
        self.register_buffer("rope_cache", yarn_rope_cache(args), persistent=False)
        self.fixed_positions: torch.Tensor | None = None  # set by context parallel

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1); projections ~ N(0, 0.02) or the depth-scaled std, their biases 0; sinks
        ~ N(0, 0.02); the router gate ~ N(0, 0.02) with bias 0; experts like an FFN with zero biases; output
        ~ N(0, dim^-0.5); normals truncated at 3 std."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = yarn_rope_cache(self.model_args)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights(buffer_device)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            _trunc_normal(self.output.weight, self.model_args.dim**-0.5)

    def forward(
        self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        """tokens [B, S] (or hidden states on a stage without the embedding); positions [S] or [B, S] (None:
        0..S-1, or the context-parallel slice's); document_ids [B, S]: attention stays within documents."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}
        balance = RouterBalance()  # transformers' load-balancing loss, over every layer's tokens together
        for key, layer in self.layers.items():
            h, moe = layer(h, self.rope_cache, positions, document_ids)
            aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
            balance.add(moe, layer.moe)
        aux_loss = balance.add_to(aux_loss)
        if self.norm is not None:
            h = self.norm(h)
        out = self.output(h) if self.output is not None else h
        if self.tok_embeddings is None or self.output is None:
            return out  # a pipeline stage: activations only
        return ModelOutput(logits=out, aux_loss=aux_loss, metrics=metrics)
