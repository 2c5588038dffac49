"""GPT-OSS: grouped-query attention with biases and a learned sink per head, layers alternating a sliding
window and full attention (attention kinds of the shared kernel, models/common/attention.py), YaRN RoPE in
the half layout, and the shared MoE layer with a biased router and clamped-SwiGLU experts with biases.

The decoder around them is the one shared with Qwen3-MoE and DeepSeek-V3 (models/common/moe_transformer.py).
Follows protocols.model.ModelProtocol like Qwen3-MoE: a whole model returns a ModelOutput (logits, the balance
loss, per-layer expert load); a pipeline stage returns plain tensors.
"""

import torch
from torch import nn

from torchtitan.models.common.attention import AttentionSinks, ScaledDotProductAttention
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.moe_transformer import MoETransformer
from torchtitan.models.common.rope import apply_rope_half, rope_table, yarn_frequencies
from torchtitan.models.gpt_oss.args import SLIDING, GptOssModelArgs
from torchtitan.protocols.model import ModelOutput


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
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.wo.weight, out_std)
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


class GptOss(MoETransformer):
    def __init__(self, args: GptOssModelArgs):
        super().__init__(args, lambda layer_id: Attention(args, sliding=args.layer_type(layer_id) == SLIDING))

    def rope_table(self) -> torch.Tensor:
        return yarn_rope_cache(self.model_args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1); projections ~ N(0, 0.02) or the depth-scaled std, their biases 0; sinks
        ~ N(0, 0.02); the router gate ~ N(0, 0.02) with bias 0; experts like an FFN with zero biases; output
        ~ N(0, dim^-0.5); normals truncated at 3 std."""
        super().init_weights(buffer_device)

    def forward(
        self, tokens: torch.Tensor, *, positions: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        """tokens [B, S] (or hidden states on a stage without the embedding); positions [S] or [B, S] (None:
        0..S-1, or the context-parallel slice's); document_ids [B, S]: attention stays within documents."""
        return self.run(tokens, positions, document_ids)
