"""Named Llama 3 sizes: two small debug models and the published 3.1 shapes.

The values are shared: copy one (dataclasses.replace) before changing a field such as vocab_size.
"""

from torchtitan.models.llama3.args import RopeScalingArgs, TransformerModelArgs

llama3_flavors: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=2048,
        multiple_of=256,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=2048,
    ),
    # For multi-process tests on CPU: seconds, not minutes.
    "debugmodel_tiny": TransformerModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        multiple_of=64,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=2048,
    ),
    # debugmodel_tiny with 4 layers: enough for 2 pipeline stages per rank on 2 ranks.
    "debugmodel_tiny4": TransformerModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=2048,
        multiple_of=64,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=2048,
    ),
    "8B": TransformerModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=131072,
    ),
    "70B": TransformerModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=131072,
    ),
    "405B": TransformerModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000,
        rope_scaling=RopeScalingArgs(),
        max_seq_len=131072,
    ),
}
