"""Building blocks several model families use (the attention kernel, RoPE, Qwen3's QK-norm attention,
multi-token prediction).

A family folder imports from here and from its own files only, never from another family's folder.
"""
