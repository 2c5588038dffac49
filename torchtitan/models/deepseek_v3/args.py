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
    depth_init: bool = True
    """Projections writing into the residual stream start at std 0.02/sqrt(2 (layer + 1)) (True, as DeepSeek's
    reference initialises them) or 0.02/sqrt(2 n_layers) (False)."""
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
    # Multi-token prediction (models/common/mtp.py).
    mtp_depth: int = 0
    """Multi-token prediction depths D (DeepSeek-V3: 1; HF num_nextn_predict_layers): depth k predicts the
    token k+1 ahead through one more block (numbered after the main layers), sharing the embedding and
    output head; 0 turns it off. Trained only: inference and generation read the main logits."""
    mtp_loss_weight: float = 0.1
    """lambda: the training loss adds lambda/D * sum_k of each depth's cross entropy (DeepSeek-V3: 0.3 for
    its first 10T tokens, then 0.1)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """6 FLOPs per ACTIVE matmul parameter (only top_k of the routed experts run per token) plus the
        attention score and value matmuls (q.k over qk_head_dim, p.v over v_head_dim), fwd + bwd."""
        m = self.moe
        blocks = self.n_layers + self.mtp_depth  # each MTP depth runs one more block (a MoE one) ...
        n_moe = blocks - min(self.n_dense_layers, blocks)
        inactive = n_moe * (m.num_experts - m.top_k) * 3 * self.dim * m.hidden_dim
        attention = 6 * blocks * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len
        head = 6 * self.mtp_depth * self.dim * self.vocab_size  # ... and the shared output head once more
        return 6 * (num_non_embedding_params - inactive) + attention + head

    def divisible_by(self) -> dict[str, dict[str, int]]:
        return {
            "tp": {"n_heads": self.n_heads, "dim": self.dim, "vocab_size": self.vocab_size},
            "ep": {"n_routed_experts": self.moe.num_experts},
            "etp": self.moe.hidden_sizes(),
        }

    def update_from_job(self, job_config, tokenizer) -> "DeepSeekV3ModelArgs":
        args = super().update_from_job(job_config, tokenizer)
        check_mtp_layout(args, job_config)
        return dataclasses.replace(args, moe=moe_args_for_job(args.moe, job_config))


def check_mtp_layout(args: DeepSeekV3ModelArgs, job_config) -> None:
    """Multi-token prediction runs whole on the last pipeline stage, next to the output head: its block is
    not sharded by tensor or expert parallel, and a context-parallel slice lacks the tokens that follow it
    (the shifted embeddings and labels). FSDP and PP compose with it."""
    if args.mtp_depth < 0:
        raise ValueError(f"--model.overrides mtp_depth={args.mtp_depth}: the depth must be >= 0 (0 turns MTP off)")
    if args.mtp_depth == 0:
        return
    p = job_config.parallelism
    degrees = {"tensor_parallel_degree": p.tensor_parallel_degree, "context_parallel_degree": p.context_parallel_degree,
               "expert_parallel_degree": p.expert_parallel_degree}
    used = [f"{name} {d}" for name, d in degrees.items() if d > 1]
    if used:
        raise ValueError(
            f"multi-token prediction (mtp_depth {args.mtp_depth}) runs with FSDP and pipeline parallel only, not "
            f"{', '.join(used)}; set --model.overrides mtp_depth=0 or drop that parallelism"
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature correction for a context stretched by `factor`."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
