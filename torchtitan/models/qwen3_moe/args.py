"""Shape of a Qwen3-MoE model: Qwen3's attention (QK-norm, decoupled head size) with an MoE layer in every block."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.moe.args import MoEArgs, moe_args_for_job
from torchtitan.models.common.qwen3_args import Qwen3ModelArgs


@dataclass
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    moe: MoEArgs = field(default_factory=MoEArgs)
    # hidden_dim (inherited) is HF's intermediate_size, the SwiGLU width of dense blocks, which the published
    # Qwen3-MoE models do not have (every block is MoE); it is kept to write the HF config back unchanged.

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """6 FLOPs per ACTIVE matmul parameter (top_k of the routed experts run per token) plus attention."""
        m = self.moe
        inactive = self.n_layers * (m.num_experts - m.top_k) * 3 * self.dim * m.hidden_dim
        return super().flops_per_token(num_non_embedding_params - inactive, seq_len)

    def transformer_shape(self) -> None:
        return None  # MoE blocks: the planning tools' dense-block formulas do not apply

    def divisible_by(self) -> dict[str, dict[str, int]]:
        return {**super().divisible_by(), "ep": {"n_routed_experts": self.moe.num_experts},
                "etp": self.moe.hidden_sizes()}

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "Qwen3MoeModelArgs":
        args = super().update_from_job(job_config, tokenizer)
        return dataclasses.replace(args, moe=moe_args_for_job(args.moe, job_config))
