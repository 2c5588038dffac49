"""Rotary position embeddings shared by the families: the (cos, sin) table and the two pair layouts.

Tables are [max_seq_len, head_dim/2, 2] float32 (real-valued: complex tensors are poorly supported by DTensor
and torch.compile). A family computes its own frequencies (Llama 3.1's or YaRN's scaling) and may use
`rope_table` to build the table from them.
"""

import math

import torch


def rope_table(freqs: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[max_seq_len, len(freqs), 2] float32 (cos, sin) of position x frequency; freqs in float64 so angles
    at large positions stay accurate to fp32."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def precompute_rope_cache(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """[max_seq_len, head_dim/2, 2] float32 table of (cos, sin) of position x frequency; frequency j is
    theta^(-2j/head_dim). Computed in float64 so angles at large positions stay accurate to fp32."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return rope_table(freqs, max_seq_len)


def apply_rope_interleaved(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by rope rows [S, D/2, 2] or [B, S, D/2, 2] (already gathered by position).

    Meta's convention: adjacent pairs (x0, x1), (x2, x3), ... are complex numbers multiplied by
    e^{i*angle}; written out in real arithmetic. Computed in fp32 and cast back.
    """
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = rope.float().unsqueeze(-3).unbind(-1)  # insert the head dim so rows broadcast over heads
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


def apply_rope_half(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, H, D] by rope rows [S, D/2, 2] or [B, S, D/2, 2] (already gathered by position).

    Half layout: dims j and j + D/2 form the pair rotated by frequency j. Computed in fp32 and cast back.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = rope.float().unsqueeze(-3).unbind(-1)  # insert the head dim so rows broadcast over heads
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def yarn_frequencies(
    head_dim: int, theta: float, factor: float, original_seq_len: int, beta_fast: float = 32.0,
    beta_slow: float = 1.0, truncate: bool = True,
) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: (frequencies [head_dim/2] float64, attention
    factor). Frequencies rotating more than beta_fast times over the original context are kept, those rotating
    fewer than beta_slow times are divided by `factor`, and a linear ramp blends the band between (its ends
    rounded outwards when `truncate`; GPT-OSS does not round). The attention factor 0.1 ln(factor) + 1
    scales the (cos, sin) table, so q.k grows by its square. factor <= 1: plain RoPE, factor 1."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if factor <= 1:
        return freqs, 1.0

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / max(high - low, 0.001)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp), 0.1 * math.log(factor) + 1.0
