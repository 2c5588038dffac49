"""Shape of a Qwen3 (dense) model: one dataclass, plus the FLOP count and the parallel checks derived from it."""

from dataclasses import dataclass
from typing import Any

from torchtitan.distributed.parallel_dims import LayoutError
from torchtitan.protocols.model import BaseModelArgs, TransformerShape


@dataclass
class Qwen3ModelArgs(BaseModelArgs):
    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int = 8
    # Qwen3 fixes the head size instead of deriving it from dim / n_heads (0.6B: 16 heads x 128 = 2048 > dim 1024),
    # so the attention width n_heads * head_dim is its own number.
    head_dim: int = 128
    hidden_dim: int = 12288  # SwiGLU hidden size, as published (HF `intermediate_size`)
    vocab_size: int = 151936
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40960  # rows of the RoPE cache: the largest position the model can be given is max_seq_len-1
    # The output projection reuses the embedding matrix (the published 0.6B, 1.7B and 4B do).
    tie_embeddings: bool = False
    # Output projections of layer i are initialised with std 0.02/sqrt(2(i+1)) rather than 0.02/sqrt(2 n_layers).
    depth_init: bool = True

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """Training FLOPs (forward + backward) per token: 6 per matmul parameter (2 forward, 4 backward) plus
        the attention score and value matmuls, which have no parameters: 2 matmuls x 2 FLOPs x 3 (fwd+bwd) x
        n_layers x n_heads x head_dim x seq_len. A tied output projection is a matmul with the embedding's
        parameters, which the non-embedding count leaves out, so it is added here."""
        tied_output = self.vocab_size * self.dim if self.tie_embeddings else 0
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * seq_len
        return 6 * (num_non_embedding_params + tied_output) + attention

    def transformer_shape(self) -> TransformerShape:
        return TransformerShape(
            self.dim, self.n_layers, self.n_heads, self.head_dim, self.n_kv_heads, self.hidden_dim, self.vocab_size
        )

    def divisible_by(self) -> dict[str, dict[str, int]]:
        """Tensor parallel splits the query and kv heads and, for the embedding and loss parallel, the
        vocabulary."""
        return {"tp": {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads, "vocab_size": self.vocab_size}}

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "Qwen3ModelArgs":
        """These args resized for a job (BaseModelArgs: Qwen pads its 151,665 tokens to 151,936 rows, which the
        vocabulary rule keeps). A tied flavor refuses pipeline parallel, which would put the embedding (first
        stage) and the output projection (last stage), one matrix, on different ranks."""
        pp = job_config.parallelism.pipeline_parallel_degree
        if self.tie_embeddings and pp > 1:
            raise LayoutError(
                f"Qwen3 {job_config.model.flavor} ties its output projection to the embedding, which pipeline "
                f"parallel would put on different stages (pipeline_parallel_degree {pp}); train it with FSDP/TP/CP "
                f"instead, or pick an untied flavor (8B and up)"
            )
        return super().update_from_job(job_config, tokenizer)
