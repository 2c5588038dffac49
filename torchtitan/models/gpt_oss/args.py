"""Shape of a GPT-OSS model: grouped-query attention with biases and per-head sinks, layers alternating a
sliding window and full attention, YaRN RoPE, and an MoE layer (router and experts with biases, clamped
SwiGLU) in every block."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from torchtitan.components.moe.args import MoEArgs, moe_args_for_job
from torchtitan.models.common.attention import check_window
from torchtitan.protocols.model import BaseModelArgs

SLIDING, FULL = "sliding_attention", "full_attention"


def gpt_oss_moe(num_experts: int, hidden_dim: int, top_k: int) -> MoEArgs:
    """GPT-OSS routing: top-k of the router's logits (a linear layer with bias), softmax over the chosen
    (= softmax over all, renormalised over the top k), no shared expert; clamped-SwiGLU experts."""
    return MoEArgs(num_experts=num_experts, num_shared_experts=0, hidden_dim=hidden_dim, top_k=top_k,
                   score_func="softmax", route_norm=True, route_scale=1.0, router_bias=True,
                   experts="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0)


@dataclass
class GptOssModelArgs(BaseModelArgs):
    dim: int = 2880
    n_layers: int = 24
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    norm_eps: float = 1e-5
    max_seq_len: int = 131072
    sliding_window: int = 128
    """Keys a sliding-window layer's query sees, itself included (HF `sliding_window`)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer, "sliding_attention" or "full_attention"; None: alternating, starting with sliding (the
    published models)."""
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    """YaRN context extension factor (1: plain RoPE)."""
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    """Round YaRN's ramp ends outwards (transformers' default); the GPT-OSS configs say false."""
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32, 2880, 4))
    depth_init: bool = True

    def __post_init__(self) -> None:
        check_window(self.sliding_window)
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            bad = [t for t in self.layer_types if t not in (SLIDING, FULL)]
            if bad or len(self.layer_types) != self.n_layers:
                raise ValueError(
                    f"layer_types must give one of {SLIDING!r} / {FULL!r} for each of the {self.n_layers} layers, "
                    f"got {list(self.layer_types)}"
                )

    def layer_type(self, layer_id: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[layer_id]
        return SLIDING if layer_id % 2 == 0 else FULL

    def flops_per_token(self, num_non_embedding_params: int, seq_len: int) -> int:
        """6 FLOPs per ACTIVE matmul parameter (top_k of the routed experts run per token) plus attention,
        whose keys per query are min(window, seq_len) in a sliding layer (on average, about that)."""
        m = self.moe
        one_expert = 3 * self.dim * m.hidden_dim + 2 * m.hidden_dim + self.dim
        inactive = self.n_layers * (m.num_experts - m.top_k) * one_expert
        keys = sum(min(self.sliding_window, seq_len) if self.layer_type(i) == SLIDING else seq_len
                   for i in range(self.n_layers))
        return 6 * (num_non_embedding_params - inactive) + 12 * self.n_heads * self.head_dim * keys

    def transformer_shape(self) -> None:
        return None  # MoE blocks: the planning tools' dense-block formulas do not apply

    def divisible_by(self) -> dict[str, dict[str, int]]:
        """TP splits the query and kv heads (and the sinks with them) and the vocabulary; EP the experts, or with
        EP 1 TP each expert's hidden units."""
        return {"tp": {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads, "vocab_size": self.vocab_size},
                "ep": {"n_routed_experts": self.moe.num_experts}, "etp": self.moe.hidden_sizes()}

    def update_from_job(self, job_config: Any, tokenizer: Any) -> "GptOssModelArgs":
        """The flavor's embedding rows are kept when the tokenizer fits in them (the published 201,088 rows
        pad o200k_harmony), a larger tokenizer grows them; the job's `moe` section applies."""
        resized = super().update_from_job(job_config, tokenizer)
        return dataclasses.replace(resized, vocab_size=max(self.vocab_size, tokenizer.vocab_size),
                                   moe=moe_args_for_job(self.moe, job_config))
