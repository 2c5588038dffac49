"""Named Qwen3 (dense) sizes: debug models and the published shapes.

The published numbers are those of the Hugging Face configs of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B} (the
base and post-trained models share them): head_dim 128, 8 kv heads, vocabulary 151936, RoPE theta 1e6, RMSNorm
eps 1e-6, 40960 positions; the three small sizes tie the output projection to the embedding.

    flavor  dim   layers  heads  kv  hidden (intermediate_size)  tied   parameters (non-embedding)
    0.6B    1024  28      16     8   3072                        yes    0.60B (0.44B)
    1.7B    2048  28      16     8   6144                        yes    1.72B (1.41B)
    4B      2560  36      32     8   9728                        yes    4.02B (3.63B)
    8B      4096  36      32     8   12288                       no     8.19B (6.95B)
    14B     5120  40      40     8   17408                       no     14.77B (13.21B)
    32B     5120  64      64     8   25600                       no     32.76B (31.21B)

(tests/unit/test_qwen3_model.py checks these parameter counts, which Qwen's model cards quote.)

The values are shared: copy one (dataclasses.replace) before changing a field such as vocab_size.
"""

from torchtitan.models.common.qwen3_args import Qwen3ModelArgs


def _published(dim: int, n_layers: int, n_heads: int, hidden_dim: int, tie: bool) -> Qwen3ModelArgs:
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, head_dim=128, hidden_dim=hidden_dim,
        vocab_size=151936, norm_eps=1e-6, rope_theta=1_000_000.0, max_seq_len=40960, tie_embeddings=tie,
    )


def _debug(dim: int, n_layers: int, n_heads: int, head_dim: int, hidden_dim: int, tie: bool) -> Qwen3ModelArgs:
    # n_heads * head_dim != dim on purpose: the decoupled head size is what a debug run must exercise.
    return Qwen3ModelArgs(
        dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads // 2, head_dim=head_dim,
        hidden_dim=hidden_dim, vocab_size=2048, rope_theta=1_000_000.0, max_seq_len=2048, tie_embeddings=tie,
    )


qwen3_flavors: dict[str, Qwen3ModelArgs] = {
    # Tied like the small published sizes; the flavor of train_configs/qwen3_debug.toml.
    "debugmodel": _debug(dim=256, n_layers=6, n_heads=8, head_dim=64, hidden_dim=768, tie=True),
    # For multi-process tests on CPU: seconds, not minutes. Tied, like 0.6B-4B.
    "debugmodel_tiny": _debug(dim=64, n_layers=2, n_heads=4, head_dim=32, hidden_dim=192, tie=True),
    # The same untied, like 8B and up: the tiny flavor that pipeline parallel accepts.
    "debugmodel_tiny_untied": _debug(dim=64, n_layers=2, n_heads=4, head_dim=32, hidden_dim=192, tie=False),
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tie=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tie=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tie=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie=False),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tie=False),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tie=False),
}
