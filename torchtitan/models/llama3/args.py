"""Shape of a Llama 3 / 3.1 model: one dataclass, plus the FLOP count derived from it."""

import math
from dataclasses import dataclass

from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.protocols.model import BaseModelArgs, TransformerShape


@dataclass
class RopeScalingArgs:
    """Llama 3.1 RoPE frequency scaling: long wavelengths are slowed by `factor`, short ones kept,
    and the band in between is blended, so a model trained at 8k positions extends to 128k."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class TransformerModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    # Explicit head size (HF `head_dim`, which transformers' LlamaConfig lets differ from hidden_size / heads);
    # None: dim // n_heads, Meta's recipe, recomputed when an override changes dim or n_heads.
    attn_head_dim: int | None = None
    vocab_size: int = 128256
    multiple_of: int = 256  # the FFN hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    # Explicit FFN hidden size; overrides the multiple_of/ffn_dim_multiplier recipe. Set when importing
    # a Hugging Face config, which only records the final `intermediate_size`.
    ffn_hidden_dim: int | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingArgs | None = None
    max_seq_len: int = 2048  # rows of the RoPE cache: the largest position the model can be given is max_seq_len-1
    # Output projections of layer i are initialised with std 0.02/sqrt(2(i+1)) rather than 0.02/sqrt(2 n_layers).
    depth_init: bool = True
    # The output projection reuses the embedding matrix (HF `tie_word_embeddings`; Llama 3.2 1B and 3B).
    tie_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads if self.attn_head_dim is None else self.attn_head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size, computed the way Meta's reference does: 2/3 of 4*dim (so the three SwiGLU
        matrices cost what two 4*dim matrices would), scaled, then rounded up to `multiple_of`."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token: 6 per matmul parameter (2 forward, 4 backward)
        plus the attention score and value matmuls, which have no parameters: 2 matmuls x 2 FLOPs x 3
        (fwd+bwd) x n_layers x n_heads x head_dim x seq_len. The causal half is not discounted."""
        tied_output = self.vocab_size * self.dim if self.tie_embeddings else 0  # a matmul, counted as embedding
        return 6 * (num_non_embedding_params + tied_output) + 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def divisible_by(self) -> dict[str, dict[str, int]]:
        """Tensor parallel splits the heads, the kv heads, the model dim (sequence-parallel norms see whole
        rows, but the embedding is split row-wise over the vocabulary) and the vocabulary (loss parallel)."""
        return {
            "tp": {"n_heads": self.n_heads, "n_kv_heads": self.num_kv_heads, "dim": self.dim, "vocab_size": self.vocab_size}
        }

    def update_from_job(self, job_config, tokenizer) -> "TransformerModelArgs":
        """Resized for the job (BaseModelArgs); a tied model refuses pipeline parallel, which would put the
        embedding (first stage) and the output projection (last stage), one matrix, on different ranks."""
        pp = job_config.parallelism.pipeline_parallel_degree
        if self.tie_embeddings and pp > 1:
            raise LayoutError(
                f"this Llama ties its output projection to the embedding, which pipeline parallel would put on "
                f"different stages (pipeline_parallel_degree {pp}); train it with FSDP/TP/CP instead"
            )
        return super().update_from_job(job_config, tokenizer)

    def transformer_shape(self) -> TransformerShape:
        return TransformerShape(
            self.dim, self.n_layers, self.n_heads, self.head_dim, self.num_kv_heads, self.hidden_dim, self.vocab_size
        )
