"""Qwen3-MoE: Qwen3's attention (models/common/qk_norm_attention.py) and the shared MoE layer in every block, in
the MoE decoder shared with GPT-OSS and DeepSeek-V3 (models/common/moe_transformer.py).

Follows protocols.model.ModelProtocol like Qwen3. A whole model returns a ModelOutput (logits, the balance
loss, per-layer expert load); a pipeline stage returns plain tensors.
"""

import torch

from torchtitan.models.common.moe_transformer import MoETransformer
from torchtitan.models.common.qk_norm_attention import QKNormAttention
from torchtitan.models.common.rope import precompute_rope_cache
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs
from torchtitan.protocols.model import ModelOutput


class Qwen3Moe(MoETransformer):
    def __init__(self, args: Qwen3MoeModelArgs):
        if args.tie_embeddings:
            raise ValueError("Qwen3-MoE flavors have an untied output projection; tie_embeddings must be False")
        super().__init__(args, lambda layer_id: QKNormAttention(args))

    def rope_table(self) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.head_dim, a.max_seq_len, a.rope_theta)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> ModelOutput | torch.Tensor:
        return self.run(tokens, positions)
