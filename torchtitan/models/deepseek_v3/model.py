"""DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE blocks.

MLA compresses the keys/values of a token into a kv_lora_rank latent (and, optionally, the query into a
q_lora_rank one). Each head's query/key has a "nope" part expanded from the latent and a "rope" part
carrying the position: the query's is per head, the key's is one vector shared by all heads (decoupled
RoPE), taken straight from the hidden state. RoPE uses adjacent pairs (as DeepSeek's weights expect) and
YaRN frequency scaling for long contexts.

The decoder stack (embedding, blocks, norm, output, multi-token prediction when `mtp_depth` > 0) is the MoE
stack the MoE families share (models/common/moe_transformer.py): this folder gives MLA, the YaRN RoPE table
and the dense first blocks. Built for being cut up like llama3 (see protocols/model.py).
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.moe_transformer import MoETransformer
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, yarn_mscale
from torchtitan.models.common.rope import apply_rope_interleaved as apply_rope
from torchtitan.models.common.rope import rope_table
from torchtitan.components.moe.moe import SwiGLU
from torchtitan.protocols.model import ModelOutput


def yarn_rope_cache(args: DeepSeekV3ModelArgs) -> torch.Tensor:
    """[max_seq_len, rope_dim/2, 2] (cos, sin) table with YaRN scaling: frequencies whose wavelength fits in
    the original context many times (> beta_fast rotations) are kept, those rotating < beta_slow times are
    divided by rope_factor, and a linear ramp blends the band between. The table is scaled by YaRN's
    attention factor mscale/mscale_all_dim (1 for the published configs)."""
    dim, theta, factor = args.qk_rope_head_dim, args.rope_theta, args.rope_factor
    freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    attention_factor = 1.0
    if factor > 1:

        def correction_dim(rotations: float) -> float:
            return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(args.beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
        attention_factor = yarn_mscale(factor, args.mscale) / yarn_mscale(factor, args.mscale_all_dim)
    return rope_table(freqs, args.max_seq_len) * attention_factor


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class MLA(nn.Module):
    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.args = args
        qk, h = args.qk_head_dim, args.n_heads
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, h * qk, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(args.q_lora_rank, eps=1e-6)
            self.wq_b = nn.Linear(args.q_lora_rank, h * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.wkv_b = nn.Linear(args.kv_lora_rank, h * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(h * args.v_head_dim, args.dim, bias=False)
        # YaRN sharpens the softmax by mscale_all_dim's correction, squared (on q.k).
        self.softmax_scale = qk**-0.5 * yarn_mscale(args.rope_factor, args.mscale_all_dim) ** 2
        self.inner_attention = ScaledDotProductAttention()
        # Under tensor parallel each rank holds some heads; the shared rope key feeds all of them, so its
        # gradient is a sum over the tp ranks: parallelize sets this to an all-reduce in backward.
        self.shared_key_grad: Callable[[torch.Tensor], torch.Tensor] = _identity

    def init_weights(self, out_std: float) -> None:
        linears = [self.wkv_a, self.wkv_b] + (
            [self.wq] if self.args.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        )
        for w in linears:
            trunc_normal(w.weight, 0.02)
        trunc_normal(self.wo.weight, out_std)
        self.kv_norm.reset_parameters()
        if self.args.q_lora_rank:
            self.q_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        a = self.args
        bs, slen, _ = x.shape
        rope = rope_cache[positions] if positions is not None else rope_cache[:slen]
        q = self.wq(x) if a.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, slen, -1, a.qk_head_dim)  # -1: the heads this (tensor-parallel) rank holds
        q_nope, q_rope = q.split([a.qk_nope_head_dim, a.qk_rope_head_dim], dim=-1)
        q = torch.cat((q_nope, apply_rope(q_rope, rope)), dim=-1)
        kv, k_rope = self.wkv_a(x).split([a.kv_lora_rank, a.qk_rope_head_dim], dim=-1)
        k_rope = self.shared_key_grad(apply_rope(k_rope.unsqueeze(2), rope))
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, slen, -1, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, v = kv.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        # The attention kernels scale by 1/sqrt(head dim); q carries the rest of MLA's scale.
        q = q * (self.softmax_scale * a.qk_head_dim**0.5)
        out = self.inner_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, slen, -1))


class DeepSeekV3Model(MoETransformer):
    """MLA in every block; the first n_dense_layers blocks have a dense SwiGLU feed-forward, the others (and the
    MTP blocks) DeepSeekMoE; the stack, its init order and forward are models/common/moe_transformer.py's."""

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__(
            args, lambda layer_id: MLA(args),
            feed_forward=lambda layer_id: SwiGLU(args.dim, args.inter_dim) if layer_id < args.n_dense_layers else None,
            mtp_depth=args.mtp_depth, mtp_loss_weight=args.mtp_loss_weight,
        )

    def rope_table(self) -> torch.Tensor:
        return yarn_rope_cache(self.model_args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1); input projections and the router ~ N(0, 0.02); projections writing into the
        residual stream ~ N(0, 0.02/sqrt(2(layer+1))); output ~ N(0, dim^-0.5); truncated at 3 std."""
        super().init_weights(buffer_device)

    def forward(
        self,
        tokens: torch.Tensor,
        mtp_embeddings: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor | tuple[torch.Tensor, ...]:
        """tokens [B, S] (or hidden states on a later pipeline stage, with the input embeddings that
        multi-token prediction reads as `mtp_embeddings`). Returns a ModelOutput on a whole model; on a
        pipeline stage the hidden states (with the embeddings while training MTP), or on the last the
        logits (with the MTP logits while training it)."""
        return self.run(tokens, positions, mtp_embeddings=mtp_embeddings)
