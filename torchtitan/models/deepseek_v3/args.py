"""Shape of a DeepSeek-V3 model (also DeepSeek-V2-Lite's shape): MLA attention, dense first layers, then MoE."""

import dataclasses
import math
from dataclasses import dataclass, field

from torchtitan.components.moe.args import MoEArgs, moe_args_for_job
from torchtitan.protocols.model import BaseModelArgs


@dataclass
class DeepSeekV3ModelArgs(BaseModelArgs):
    vocab_size: int = 102400
    dim: int = 2048
    inter_dim: int = 10944
    """SwiGLU hidden size of the dense layers."""
    n_layers: int = 27
    n_dense_layers: int = 1
    """The first n_dense_layers blocks have a dense FFN; the rest are MoE."""
    n_heads: int = 16
    norm_eps: float = 1e-6
    moe: MoEArgs = field(default_factory=MoEArgs)
    # Multi-head latent attention.
    q_lora_rank: int = 0
    """Rank of the compressed query; 0: queries are projected directly from the hidden state."""
    kv_lora_rank: int = 512
    """Rank of the compressed key/value latent."""
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    """The decoupled RoPE part of each query/key head (one shared key part for all heads)."""
    v_head_dim: int = 128
    # RoPE with YaRN context extension (factor 1: plain RoPE).
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 1.0
    original_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """6 FLOPs per ACTIVE matmul parameter (only top_k of the routed experts run per token) plus the
        attention score and value matmuls (q.k over qk_head_dim, p.v over v_head_dim), fwd + bwd."""
        m = self.moe
        n_moe = self.n_layers - self.n_dense_layers
        inactive = n_moe * (m.num_experts - m.top_k) * 3 * self.dim * m.hidden_dim
        attention = 6 * self.n_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        return 6 * (num_non_embedding_params - inactive) + attention

    def divisible_by(self) -> dict[str, dict[str, int]]:
        return {
            "tp": {"n_heads": self.n_heads, "dim": self.dim, "vocab_size": self.vocab_size},
            "ep": {"n_routed_experts": self.moe.num_experts},
        }

    def update_from_job(self, job_config, tokenizer) -> "DeepSeekV3ModelArgs":
        args = super().update_from_job(job_config, tokenizer)
        return dataclasses.replace(args, moe=moe_args_for_job(args.moe, job_config))


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
