"""DeepSeek-V3: multi-head latent attention (MLA) and DeepSeekMoE blocks.

MLA compresses the keys/values of a token into a kv_lora_rank latent (and, optionally, the query into a
q_lora_rank one). Each head's query/key has a "nope" part expanded from the latent and a "rope" part
carrying the position: the query's is per head, the key's is one vector shared by all heads (decoupled
RoPE), taken straight from the hidden state. RoPE uses adjacent pairs (as DeepSeek's weights expect) and
YaRN frequency scaling for long contexts.

Built for being cut up like llama3 (see protocols/model.py): layers keyed by index, head/tail modules may
be None on a pipeline stage. A whole model returns a ModelOutput (logits, the MoE balance loss, per-layer
expert load); a pipeline stage returns plain tensors (stages pass activations only).

Multi-token prediction (`mtp_depth` > 0, models/common/mtp.py) trains D more blocks after the output: in
training a whole model adds their logits to its ModelOutput; under pipeline parallel the MTP module sits on
the last stage (a tail module), every earlier stage passes the input tokens' embeddings on beside the hidden
state (so the one shared embedding gets the MTP's gradient through the pipeline), and the last stage returns
(logits, *mtp_logits). In eval mode (validation, generation) the model computes the main logits only.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.init import trunc_normal
from torchtitan.models.common.mtp import MultiTokenPrediction
from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs, yarn_mscale
from torchtitan.models.common.rope import apply_rope_interleaved as apply_rope
from torchtitan.models.common.rope import rope_table
from torchtitan.components.moe import MoE, MoEOutput
from torchtitan.components.moe.moe import SwiGLU, add_layer_stats
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


class Block(nn.Module):
    def __init__(self, layer_id: int, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = MLA(args)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.moe_enabled = layer_id >= args.n_dense_layers
        if self.moe_enabled:
            self.moe = MoE(args.dim, args.moe)
        else:
            self.feed_forward = SwiGLU(args.dim, args.inter_dim)
        self.out_init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def init_weights(self, buffer_device: torch.device | None) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.out_init_std)
        if self.moe_enabled:
            self.moe.init_weights(self.out_init_std, buffer_device)
        else:
            self.feed_forward.init_weights(self.out_init_std)

    def forward(
        self, x: torch.Tensor, rope_cache: torch.Tensor, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        """(output, the MoE layer's output for its loss and load; None in a dense layer)."""
        h = x + self.attention(self.attention_norm(x), rope_cache, positions)
        if not self.moe_enabled:
            return h + self.feed_forward(self.ffn_norm(h)), None
        moe = self.moe(self.ffn_norm(h))
        return h + moe.out, moe


class DeepSeekV3Model(nn.Module):
    pipeline_head = ("tok_embeddings",)
    pipeline_tail = ("norm", "output")

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__()
        self.model_args = args
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(i, args) for i in range(args.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.register_buffer("rope_cache", yarn_rope_cache(args), persistent=False)
        # DeepSeek-V3's MTP blocks are numbered after the main layers (HF: model.layers.{n_layers + k - 1}).
        self.mtp: MultiTokenPrediction | None = None
        if args.mtp_depth:
            blocks = [Block(args.n_layers + k, args) for k in range(args.mtp_depth)]
            self.mtp = MultiTokenPrediction(args.dim, args.norm_eps, blocks)
            self.pipeline_tail = (*self.pipeline_tail, "mtp")  # held by the last stage, with the output
        self.mtp_depth, self.mtp_loss_weight = args.mtp_depth, args.mtp_loss_weight  # protocols.model.mtp_settings
        # Set by context parallel: the true positions of this rank's load-balanced slice.
        self.fixed_positions: torch.Tensor | None = None

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Embedding ~ N(0, 1); input projections and the router ~ N(0, 0.02); projections writing into the
        residual stream ~ N(0, 0.02/sqrt(2(layer+1))); output ~ N(0, dim^-0.5); truncated at 3 std."""
        with torch.device(buffer_device or self.rope_cache.device):
            self.rope_cache = yarn_rope_cache(self.model_args)
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
        mtp = self.model_args.mtp_depth > 0 and self.training
        if self.tok_embeddings is not None:
            h = mtp_embeddings = self.tok_embeddings(tokens)
        else:
            h = tokens
        if positions is None:
            positions = self.fixed_positions
        aux_loss, metrics = None, {}

        def run_block(key: str, layer: Block, x: torch.Tensor) -> torch.Tensor:
            nonlocal aux_loss
            x, moe = layer(x, self.rope_cache, positions)
            if moe is not None:
                aux_loss = add_layer_stats(aux_loss, metrics, key, moe, layer.moe)
            return x

        for key, layer in self.layers.items():
            h = run_block(key, layer, h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is None:  # a stage before the last: activations only
            return (h, mtp_embeddings) if mtp else h
        logits = self.output(h)
        mtp_logits = []
        if mtp:  # depth k's block is layer n_layers + k - 1 in the metrics, as in HF checkpoints
            n = self.model_args.n_layers
            mtp_logits = self.mtp(h, mtp_embeddings, self.output, lambda k, b, x: run_block(str(n + k - 1), b, x))
        if self.tok_embeddings is None:
            return (logits, *mtp_logits) if mtp else logits  # the balance loss is refused under PP
        return ModelOutput(logits=logits, aux_loss=aux_loss, metrics=metrics, mtp_logits=mtp_logits)
