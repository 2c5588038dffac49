"""MXFP4 expert tensors of the published GPT-OSS checkpoints, dequantized as they are read, per rank.

The Hub folders store each routed-expert projection `P` (gate_up_proj, down_proj: [E, in, out] as the model
holds them) as two tensors, in the layout of transformers' MXFP4 integration:
    P_blocks  uint8 [E, out, in / 32, 16]  two FP4 (e2m1) values per byte, the low nibble first
    P_scales  uint8 [E, out, in / 32]      a shared power of two per block of 32 values, biased by 127
so value (e, o, 32 g + j) = FP4[nibble j of blocks[e, o, g]] * 2^(scales[e, o, g] - 127).

`Mxfp4Reader` wraps a folder's slice reader so the load paths see plain `P` tensors: a rank asking for a box
of P (its experts, under EP/FSDP) reads only those experts' blocks and scales, and gets exact float32 values
(every FP4 value times a power of two is a float32).
"""

import math

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


class Mxfp4Error(ValueError):
    """An MXFP4 tensor pair that cannot be dequantized; the message names it and the fix."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32] (the stored row order)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1).to(torch.float32)).flatten(-2)


class Mxfp4Reader:
    """A SliceReader (components/checkpoint/hf_folder.py) of a folder whose `P_blocks` / `P_scales` pairs read as `P`."""

    def __init__(self, reader):
        self.inner, self.folder = reader, reader.folder
        quantized = {k[: -len(BLOCKS_SUFFIX)] for k in reader.where if k.endswith(BLOCKS_SUFFIX)}
        self.quantized = {k for k in quantized if k + SCALES_SUFFIX in reader.where}
        hidden = {k + s for k in self.quantized for s in (BLOCKS_SUFFIX, SCALES_SUFFIX)}
        self.where = {k: f for k, f in reader.where.items() if k not in hidden}
        self.where.update({k: reader.where[k + BLOCKS_SUFFIX] for k in self.quantized})

    def shape(self, key: str) -> list[int]:
        if key not in self.quantized:
            return self.inner.shape(key)
        blocks, scales = self.inner.shape(key + BLOCKS_SUFFIX), self.inner.shape(key + SCALES_SUFFIX)
        if len(blocks) != 4 or blocks[-1] != BLOCK // 2 or scales != blocks[:-1]:
            raise Mxfp4Error(
                f"{self.folder}: MXFP4 tensor {key}: scales {scales} do not match blocks {blocks} (expected blocks "
                f"[E, out, in/32, 16] and scales [E, out, in/32]); the checkpoint is damaged or not MXFP4"
            )
        e, out, groups, _ = blocks
        return [e, groups * BLOCK, out]

    def read(self, key: str, offsets, sizes) -> torch.Tensor:
        if key not in self.quantized:
            return self.inner.read(key, offsets, sizes)
        self.shape(key)  # checks the pair
        (e0, i0, o0), (ne, ni, no) = list(offsets), list(sizes)
        g0, g1 = i0 // BLOCK, math.ceil((i0 + ni) / BLOCK)  # the scale blocks covering the box's inputs
        blocks = self.inner.read(key + BLOCKS_SUFFIX, [e0, o0, g0, 0], [ne, no, g1 - g0, BLOCK // 2])
        scales = self.inner.read(key + SCALES_SUFFIX, [e0, o0, g0], [ne, no, g1 - g0])
        values = dequantize(blocks, scales)[..., i0 - g0 * BLOCK : i0 - g0 * BLOCK + ni]  # [ne, no, ni]
        return values.transpose(1, 2).contiguous()
