"""Building blocks several model families use (the attention kernel, RoPE, Qwen3's QK-norm attention,
multi-token prediction, the MoE decoder of Qwen3-MoE and GPT-OSS, the truncated-normal weight init).

A family folder imports from here and from its own files only, never from another family's folder.
"""
