"""Named GPT-OSS sizes: debug models and the published shapes (the Hugging Face configs of openai/gpt-oss-20b
and openai/gpt-oss-120b): dim 2880, 64 query heads and 8 kv heads of 64, every block MoE with top-4 routing over
experts of hidden size 2880, layers alternating a 128-token sliding window and full attention, YaRN (theta
150000, factor 32 over 4096 positions, 131072 in all), vocabulary 201088, untied output.

    flavor   layers  experts  total / active parameters (per the model card)
    20b      24      32       20.9B / 3.6B
    120b     36      128      116.8B / 5.1B
"""

from torchtitan.models.gpt_oss.args import GptOssModelArgs, gpt_oss_moe

gpt_oss_flavors: dict[str, GptOssModelArgs] = {
    "debugmodel": GptOssModelArgs(
        dim=256, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048, max_seq_len=2048,
        sliding_window=32, moe=gpt_oss_moe(8, 128, 2),
    ),
    # For multi-process tests on CPU: a window of 8 is shorter than a cp chunk at the tests' sequence lengths.
    "debugmodel_tiny": GptOssModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=2048, max_seq_len=2048,
        sliding_window=8, moe=gpt_oss_moe(8, 32, 2),
    ),
    "20b": GptOssModelArgs(n_layers=24, moe=gpt_oss_moe(32, 2880, 4)),
    "120b": GptOssModelArgs(n_layers=36, moe=gpt_oss_moe(128, 2880, 4)),
}
