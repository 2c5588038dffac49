"""Named DeepSeek sizes: debug models, the 16B (DeepSeek-V2-Lite shape) and the published 671B (V3).

Published shapes: DeepSeek-V3 config.json (deepseek-ai/DeepSeek-V3) and DeepSeek-V2-Lite config.json
(deepseek-ai/DeepSeek-V2-Lite); the 16B flavor trains that shape with this folder's architecture.
"""

from torchtitan.models.deepseek_v3.args import DeepSeekV3ModelArgs
from torchtitan.components.moe import MoEArgs

deepseek_v3_flavors: dict[str, DeepSeekV3ModelArgs] = {
    "debugmodel": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=256, inter_dim=1024, n_layers=6, n_dense_layers=1, n_heads=16,
        moe=MoEArgs(num_experts=8, num_shared_experts=2, hidden_dim=256, top_k=3, score_func="softmax",
                    route_norm=False, route_scale=1.0),
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    ),
    # For multi-process tests on CPU: V3 routing (sigmoid, 2 groups of 4, pick 1), MLA with compressed q,
    # a dense first layer; 4 layers so that 2 pipeline stages both hold MoE layers.
    "debugmodel_tiny": DeepSeekV3ModelArgs(
        vocab_size=2048, dim=64, inter_dim=128, n_layers=4, n_dense_layers=1, n_heads=4,
        moe=MoEArgs(num_experts=8, num_shared_experts=1, hidden_dim=32, top_k=2, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=2, topk_groups=1),
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "16B": DeepSeekV3ModelArgs(
        vocab_size=102400, dim=2048, inter_dim=10944, n_layers=27, n_dense_layers=1, n_heads=16,
        moe=MoEArgs(num_experts=64, num_shared_experts=2, hidden_dim=1408, top_k=6, score_func="softmax",
                    route_norm=False, route_scale=1.0),
        q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=163840, rope_theta=10000.0, rope_factor=40.0, original_seq_len=4096,
        mscale=0.707, mscale_all_dim=0.707,
    ),
    "671B": DeepSeekV3ModelArgs(
        vocab_size=129280, dim=7168, inter_dim=18432, n_layers=61, n_dense_layers=3, n_heads=128,
        moe=MoEArgs(num_experts=256, num_shared_experts=1, hidden_dim=2048, top_k=8, score_func="sigmoid",
                    route_norm=True, route_scale=2.5, n_groups=8, topk_groups=4),
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=163840, rope_theta=10000.0, rope_factor=40.0, original_seq_len=4096,
        mscale=1.0, mscale_all_dim=1.0,
    ),
}
