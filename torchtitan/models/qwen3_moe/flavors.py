"""Named Qwen3-MoE sizes: debug models and the published shapes (the Hugging Face configs of
Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B): 128 experts, 8 per token, softmax routing with the top-8
weights renormalised, no shared expert, every block MoE, head_dim 128, 4 kv heads, vocabulary 151936,
RoPE theta 1e6, 40960 positions, untied output.

    flavor      dim   layers  heads  experts x hidden  total / active parameters (per the model cards)
    30B-A3B     2048  48      32     128 x 768         30.5B / 3.3B
    235B-A22B   4096  94      64     128 x 1536        235B / 22B
"""

from torchtitan.components.moe.args import MoEArgs
from torchtitan.models.qwen3_moe.args import Qwen3MoeModelArgs


def _routing(num_experts: int, hidden_dim: int, top_k: int) -> MoEArgs:
    return MoEArgs(num_experts=num_experts, num_shared_experts=0, hidden_dim=hidden_dim, top_k=top_k,
                   score_func="softmax", route_norm=True, route_scale=1.0)


qwen3_moe_flavors: dict[str, Qwen3MoeModelArgs] = {
    "debugmodel": Qwen3MoeModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=64, hidden_dim=768, vocab_size=2048,
        max_seq_len=2048, moe=_routing(16, 128, 4),
    ),
    # For multi-process tests on CPU.
    "debugmodel_tiny": Qwen3MoeModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, hidden_dim=128, vocab_size=2048,
        max_seq_len=2048, moe=_routing(8, 32, 2),
    ),
    "30B-A3B": Qwen3MoeModelArgs(
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, hidden_dim=6144, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960, moe=_routing(128, 768, 8),
    ),
    "235B-A22B": Qwen3MoeModelArgs(
        dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, hidden_dim=12288, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960, moe=_routing(128, 1536, 8),
    ),
}
