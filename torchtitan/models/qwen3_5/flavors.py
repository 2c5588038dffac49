"""Named Qwen3.5 sizes: debug models and published shapes.

Where the numbers come from (no network here; checked with the `search` tool's stored public texts):
- Every published size: vocabulary 248,320, head_dim 256, partial_rotary_factor 0.25, RoPE theta 1e7,
  262,144 positions, DeltaNet head dims 128 and 16 key heads, conv kernel 4, every 4th layer full attention,
  norm eps 1e-6: the `text_config` of Qwen/Qwen3.5-0.8B's and Qwen/Qwen3.5-35B-A3B's config.json as mirrored in
  public test fixtures (found by `find_string '"linear_num_value_heads": 16'` / `'"moe_intermediate_size": 512'`),
  and THUDM/slime scripts/models/qwen3.5-*.sh (rotary-base 10000000, rotary-percent 0.25, kv-channels 256).
  (transformers 5's Qwen3_5TextConfig defaults are the 9B's shape but say theta 1e4 and 32,768 positions: the
  checkpoints' values win.)
- Per size (text_config): 0.8B from that config.json mirror; 2B, 4B, 9B, 27B and 35B-A3B from a public
  registry of the Hub configs (fields that differ from transformers' defaults), 35B-A3B also from slime's
  script (16/2 heads, 256 experts of 512, top 8, shared expert 512 behind a gate, 16/32 DeltaNet heads).
  Tied embeddings: 0.8B, 2B, 4B (config.json `tie_word_embeddings: true`); 9B, 27B, 35B-A3B untied.
`--model.hf_config <folder>` always reads a folder's real shape instead.

    flavor    dim   layers  heads/kv  ffn (or experts)        DeltaNet k/v heads  tied
    0.8B      1024  24      8/2       3584                    16/16               yes
    2B        2048  24      8/2       6144                    16/16               yes
    4B        2560  32      16/4      9216                    16/32               yes
    9B        4096  32      16/4      12288                   16/32               no
    27B       5120  64      24/4      17408                   16/48               no
    35B-A3B   2048  40      16/2      256 x 512, top 8, +512  16/32               no

The debug flavors differ on purpose where the code could confuse two sizes: k heads != v heads, key and
value head dims != the softmax head dim, partial RoPE.
"""

from torchtitan.components.moe.args import MoEArgs
from torchtitan.models.qwen3_5.args import Qwen3_5ModelArgs


def _moe(num_experts: int, hidden_dim: int, top_k: int, shared: int) -> MoEArgs:
    # Qwen3.5-MoE routing: softmax over experts, top-k renormalised, one shared expert behind a sigmoid gate.
    return MoEArgs(num_experts=num_experts, num_shared_experts=1, hidden_dim=hidden_dim, top_k=top_k,
                   score_func="softmax", route_norm=True, route_scale=1.0, shared_hidden_dim=shared, shared_gate=True)


def _debug(dim: int, n_layers: int, moe: MoEArgs | None = None, tie: bool = False) -> Qwen3_5ModelArgs:
    return Qwen3_5ModelArgs(
        dim=dim, n_layers=n_layers, vocab_size=2048, max_seq_len=2048, tie_embeddings=tie, hidden_dim=3 * dim,
        n_heads=4, n_kv_heads=2, head_dim=32, rope_theta=10_000_000.0, partial_rotary_factor=0.5,
        # 8 value heads: in_proj_a/b (one row per value head) then take LoRA's default rank 8.
        linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, linear_chunk_size=16, moe=moe,
    )


def _published(**kw) -> Qwen3_5ModelArgs:
    base = dict(vocab_size=248320, max_seq_len=262144, head_dim=256, rope_theta=10_000_000.0,
                partial_rotary_factor=0.25, linear_key_head_dim=128, linear_value_head_dim=128,
                linear_conv_kernel_dim=4, norm_eps=1e-6)
    return Qwen3_5ModelArgs(**{**base, **kw})


qwen3_5_flavors: dict[str, Qwen3_5ModelArgs] = {
    # 8 layers: linear, linear, linear, full, ... (two full-attention layers).
    "debugmodel": _debug(dim=256, n_layers=8),
    # Tests on CPU: a linear and a full-attention layer, untied (pipeline parallel accepts it).
    "debugmodel_tiny": Qwen3_5ModelArgs(**{**_debug(64, 2).__dict__, "layer_types": ("linear_attention", "full_attention")}),
    "debugmodel_tiny_moe": Qwen3_5ModelArgs(**{**_debug(64, 2, moe=_moe(8, 32, 2, 48)).__dict__,
                                              "layer_types": ("linear_attention", "full_attention")}),
    "0.8B": _published(dim=1024, n_layers=24, hidden_dim=3584, n_heads=8, n_kv_heads=2, linear_num_key_heads=16,
                       linear_num_value_heads=16, tie_embeddings=True),
    "2B": _published(dim=2048, n_layers=24, hidden_dim=6144, n_heads=8, n_kv_heads=2, linear_num_key_heads=16,
                     linear_num_value_heads=16, tie_embeddings=True),
    "4B": _published(dim=2560, n_layers=32, hidden_dim=9216, n_heads=16, n_kv_heads=4, linear_num_key_heads=16,
                     linear_num_value_heads=32, tie_embeddings=True),
    "9B": _published(dim=4096, n_layers=32, hidden_dim=12288, n_heads=16, n_kv_heads=4, linear_num_key_heads=16,
                     linear_num_value_heads=32),
    "27B": _published(dim=5120, n_layers=64, hidden_dim=17408, n_heads=24, n_kv_heads=4, linear_num_key_heads=16,
                      linear_num_value_heads=48),
    "35B-A3B": _published(dim=2048, n_layers=40, hidden_dim=512, n_heads=16, n_kv_heads=2, linear_num_key_heads=16,
                          linear_num_value_heads=32, moe=_moe(256, 512, 8, 512)),
}
