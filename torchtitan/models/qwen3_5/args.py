"""Shape of a Qwen3.5 model (dense or MoE): a hybrid of Gated DeltaNet linear attention and gated softmax
attention, the kind of each layer given as data (`layer_types`)."""

import dataclasses
from dataclasses import dataclass
from typing import Any

from torchtitan.components.moe.args import MoEArgs, moe_args_for_job
from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.protocols.model import BaseModelArgs, LinearAttentionShape, MoEShape, TransformerShape

LAYER_TYPES = ("linear_attention", "full_attention")


def interval_layer_types(n_layers: int, full_attention_interval: int) -> tuple[str, ...]:
    """Every `full_attention_interval`-th layer full attention, the others linear (transformers' default rule)."""
    return tuple("full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
                 for i in range(n_layers))


@dataclass
class Qwen3_5ModelArgs(BaseModelArgs):
    dim: int = 1024
    """Hidden size (HF `hidden_size`)."""
    n_layers: int = 24
    vocab_size: int = 248320
    norm_eps: float = 1e-6
    max_seq_len: int = 262144
    """Rows of the RoPE table: the largest position the model can be given is max_seq_len - 1."""
    tie_embeddings: bool = False
    hidden_dim: int = 3584
    """SwiGLU width of the dense feed-forward (HF `intermediate_size`); unused by MoE flavors."""
    layer_types: tuple[str, ...] = ()
    """Kind of each layer, `linear_attention` or `full_attention`; empty = every 4th layer full. As an override:
    `--model.overrides layer_types=linear_attention+full_attention`."""
    # Full (gated softmax) attention.
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 256
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    """RoPE rotates the first head_dim x partial_rotary_factor dims of each head; the rest pass through."""
    # Linear (Gated DeltaNet) attention.
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    """A multiple of the key heads (value head h reads key head h // (value heads / key heads))."""
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    """Width of the causal depthwise conv over q, k, v."""
    linear_chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule: the intra-chunk work is chunk^2 per token-chunk, the
    sequential part S / chunk steps; 64 as transformers and FLA."""
    moe: MoEArgs | None = None
    """Routed experts + a gated shared expert in every block (MoE flavors); None = dense SwiGLU."""
    depth_init: bool = True
    """Output projections of layer i initialised with std 0.02/sqrt(2(i+1)) rather than 0.02/sqrt(2 n_layers)."""
    hf_weight_prefix: str = "model."
    """Where the language model's weights sit in an HF folder: `model.` (Qwen3_5ForCausalLM) or
    `model.language_model.` (the multimodal Qwen3_5ForConditionalGeneration folders); read from config.json."""

    def __post_init__(self):
        self.layer_types = tuple(self.layer_types)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """layer_types, or the default rule (every 4th layer full) when they are not given."""
        return self.layer_types or interval_layer_types(self.n_layers, 4)

    def check(self) -> None:
        """One line per impossible shape (flavors, HF configs and --model.overrides all come through here: the
        model calls it when built, plan_job before any rank starts)."""
        bad = sorted({t for t in self.layer_kinds if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"Qwen3.5 layer_types: unknown layer type {bad[0]!r}; each must be one of {LAYER_TYPES}")
        if len(self.layer_kinds) != self.n_layers:
            raise ValueError(f"Qwen3.5: {len(self.layer_kinds)} layer_types for {self.n_layers} layers; give one per layer")
        if self.linear_conv_kernel_dim < 1:
            raise ValueError(f"Qwen3.5: linear_conv_kernel_dim must be >= 1, got {self.linear_conv_kernel_dim}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"Qwen3.5: linear_num_value_heads {self.linear_num_value_heads} must be a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if self.linear_chunk_size < 1:
            raise ValueError(f"Qwen3.5: linear_chunk_size must be >= 1, got {self.linear_chunk_size}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"Qwen3.5: head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                             f"must be an even number of dims in 2..head_dim")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def n_full(self) -> int:
        return sum(t == "full_attention" for t in self.layer_kinds)

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """6 FLOPs per active matmul parameter (a tied output counts: it is a matmul), plus, per token:
        full attention 12 x n_heads x head_dim x seq_len per full layer (scores and values, fwd + bwd); the
        chunked delta rule per linear layer and value head 6 x (3 dk dv + C (2 dk + dv)): the state read by q
        and by the WY keys and the state write, and the intra-chunk q k^T, k k^T and attention x values."""
        params = num_non_embedding_params + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        if self.moe is not None:
            m = self.moe
            params -= self.n_layers * (m.num_experts - m.top_k) * 3 * self.dim * m.hidden_dim
        dk, dv, c = self.linear_key_head_dim, self.linear_value_head_dim, self.linear_chunk_size
        linear = 6 * (self.n_layers - self.n_full) * self.linear_num_value_heads * (3 * dk * dv + c * (2 * dk + dv))
        full = 12 * self.n_full * self.n_heads * self.head_dim * seq_len
        return 6 * params + linear + full

    def transformer_shape(self) -> TransformerShape:
        """The sizes the memory estimator's per-block formulas read (planning/memory.py): gated softmax blocks,
        the DeltaNet blocks among them, and the MoE layer of MoE flavors."""
        moe = None
        if self.moe is not None:
            m = self.moe
            shared = m.shared_hidden_dim or m.num_shared_experts * m.hidden_dim
            moe = MoEShape(m.num_experts, m.top_k, m.hidden_dim, shared if m.num_shared_experts else 0, m.shared_gate)
        linear = LinearAttentionShape(
            self.n_layers - self.n_full, self.linear_num_key_heads, self.linear_num_value_heads,
            self.linear_key_head_dim, self.linear_value_head_dim, self.linear_chunk_size, self.linear_conv_kernel_dim,
        )
        return TransformerShape(self.dim, self.n_layers, self.n_heads, self.head_dim, self.n_kv_heads, self.hidden_dim,
                                self.vocab_size, gated_attention=True, linear_attention=linear, moe=moe)

    def divisible_by(self) -> dict[str, dict[str, int]]:
        """TP splits the softmax heads, the DeltaNet key and value heads, and the vocabulary; EP the experts, or
        with EP 1 TP each expert's hidden units."""
        out = {"tp": {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                      "linear_num_key_heads": self.linear_num_key_heads,
                      "linear_num_value_heads": self.linear_num_value_heads, "vocab_size": self.vocab_size}}
        if self.moe is not None:
            out["ep"] = {"n_routed_experts": self.moe.num_experts}
            out["etp"] = self.moe.hidden_sizes()
        return out

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "Qwen3_5ModelArgs":
        """Resized for a job (the embedding keeps its padded rows when the tokenizer fits). Refused, in one
        line: a tied flavor under pipeline parallel (embedding and output on different stages), and context
        parallel slices shorter than the conv window (the halo comes from the previous slice only)."""
        self.check()
        p = job_config.parallelism
        if self.tie_embeddings and p.pipeline_parallel_degree > 1:
            raise LayoutError(
                f"Qwen3.5 {job_config.model.flavor} ties its output projection to the embedding, which pipeline "
                f"parallel would put on different stages (pipeline_parallel_degree {p.pipeline_parallel_degree}); "
                f"train it with FSDP/TP/CP instead, or pick an untied flavor"
            )
        cp = p.context_parallel_degree
        if cp > 1 and any(t == "linear_attention" for t in self.layer_kinds):
            piece = job_config.training.seq_len // (2 * cp)
            if piece < self.linear_conv_kernel_dim - 1:
                raise LayoutError(
                    f"context parallel {cp} cuts seq_len {job_config.training.seq_len} into pieces of {piece} tokens, "
                    f"fewer than the linear attention's conv window needs from the previous piece "
                    f"({self.linear_conv_kernel_dim - 1}); use a longer --training.seq_len or a smaller "
                    f"--parallelism.context_parallel_degree"
                )
        resized = super().update_from_job(job_config, tokenizer)
        moe = moe_args_for_job(self.moe, job_config) if self.moe is not None else None
        return dataclasses.replace(resized, vocab_size=max(self.vocab_size, tokenizer.vocab_size), moe=moe)
