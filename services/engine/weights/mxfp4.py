"""MXFP4 (OCP microscaling FP4) weights as gpt-oss checkpoints store its experts, dequantized at load.

A weight [..., out, in] is stored as ``blocks`` uint8 [..., out, in / 32, 16] and ``scales`` uint8
[..., out, in / 32]: each block of 32 values shares one e8m0 scale 2^(s - 127); each byte holds two fp4
e2m1 values (low nibble = the even element, high nibble = the odd one). e2m1 codes 0..15 are
+-{0, 0.5, 1, 1.5, 2, 3, 4, 6} (bit 3 = sign).
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
"""Values sharing one scale."""

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit e2m1 code."""

E8M0_BIAS = 127
"""Exponent bias of the e8m0 scales."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in ``dtype`` (exact: every value is
    a small power-of-two multiple of an e2m1 value; dtype bf16/fp32 hold it unless the scale is extreme)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks/scales must be uint8, got {blocks.dtype}/{scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(blocks [..., G, {MXFP4_BLOCK // 2}], scales [..., G])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32]
    exp = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(lut[codes], exp.unsqueeze(-1).to(torch.float32))
    return values.flatten(-2).to(dtype)
