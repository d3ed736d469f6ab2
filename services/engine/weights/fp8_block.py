"""FP8 block-scaled checkpoints (the DeepSeek-V3 format): ``X.weight`` in float8_e4m3fn [out, in] beside
``X.weight_scale_inv`` fp32 [ceil(out / bo), ceil(in / bi)], one scale per [bo, bi] block of the weight (the
last row and column of blocks may be partial); the real weight is ``fp8 * scale`` block by block. The
``quantization_config`` that says so: ``{"quant_method": "fp8", "weight_block_size": [bo, bi],
"activation_scheme": "dynamic"}`` (ModelArchConfig.fp8_weight_block).

The engine dequantizes such weights as they stream in at load (one tensor at a time, never the whole model
in fp32), so the model holds them in its compute dtype; no FP8 GEMM runs yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

SCALE_SUFFIX = "_scale_inv"


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [out, in] and fp32 [ceil(out / bo), ceil(in / bi)] -> fp32 [out, in]. Raises ValueError for a
    scale grid that does not cover the weight in ``block`` blocks."""
    if weight.dim() != 2:
        raise ValueError(f"an FP8 block-scaled weight must be 2-D, got shape {tuple(weight.shape)}")
    out, inp = weight.shape
    bo, bi = block
    grid = (-(-out // bo), -(-inp // bi))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not cover a {out}x{inp} weight in {bo}x{bi} "
                         f"blocks (expected {grid})")
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inp]
    return weight.float() * scale


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every fp8 ``X.weight`` and its ``X.weight_scale_inv`` replaced by the dequantized fp32
    ``X.weight`` (in whichever order the two come); other tensors pass through. Raises ValueError for an fp8
    weight without its scales, or scales without their weight, once the stream ends."""
    waiting: dict[str, torch.Tensor] = {}  # "X.weight" -> the half of the pair seen first
    for name, t in weights:
        if name.endswith(SCALE_SUFFIX):
            key, is_scale = name[: -len(SCALE_SUFFIX)], True
        elif t.dtype == torch.float8_e4m3fn:
            key, is_scale = name, False
        else:
            yield name, t
            continue
        other = waiting.pop(key, None)
        if other is None:
            waiting[key] = t
            continue
        fp8, scale = (other, t) if is_scale else (t, other)
        if fp8.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{key}: scales {key + SCALE_SUFFIX} beside a {fp8.dtype} weight (expected float8_e4m3fn)")
        try:
            yield key, dequantize_block_fp8(fp8, scale, block)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
    if waiting:
        halves = sorted(k + (SCALE_SUFFIX if v.dtype != torch.float8_e4m3fn else "") for k, v in waiting.items())
        raise ValueError(f"FP8 tensors without their pair (weight + {SCALE_SUFFIX}): {halves[:4]}")
