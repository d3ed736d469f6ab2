"""FP8 block-scaled checkpoints (the DeepSeek-V3 format): ``X.weight`` in float8_e4m3fn [out, in] beside
``X.weight_scale_inv`` fp32 [ceil(out / bo), ceil(in / bi)], one scale per [bo, bi] block of the weight (the
last row and column of blocks may be partial); the real weight is ``fp8 * scale`` block by block. The
``quantization_config`` that says so: ``{"quant_method": "fp8", "weight_block_size": [bo, bi],
"activation_scheme": "dynamic"}`` (ModelArchConfig.fp8_weight_block).

On the CPU (and under tensor parallelism) the engine dequantizes such weights as they stream in at load (one
tensor at a time, never the whole model in fp32), so the model holds them in its compute dtype. On CUDA the
linears whose every source weight is fp8 keep it (``models/fp8_linear.py``): their pairs pass through
:func:`dequantized` untouched (``keep``) and run as FP8 GEMMs (``kernels/fp8_block_gemm.py``).
:func:`tensor_headers` reads the names, dtypes and shapes of a checkpoint's tensors (no data) to plan that
before any weight is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Iterator
from pathlib import Path

import torch

SCALE_SUFFIX = "_scale_inv"
SAFETENSORS_FP8 = "F8_E4M3"
"""The safetensors header's dtype of float8_e4m3fn tensors."""


def tensor_headers(files: Iterable[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of every tensor of the files, from their JSON headers (an 8-byte
    little-endian length, then the header). Raises OSError or ValueError for a file that is not safetensors."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
    return out


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """Blocks of ``block`` [rows, cols] over a 2-D weight: (cdiv(out, bo), cdiv(in, bi))."""
    out, inp = shape
    return -(-out // block[0]), -(-inp // block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp8 [out, in] and fp32 [ceil(out / bo), ceil(in / bi)] -> fp32 [out, in]. Raises ValueError for a
    scale grid that does not cover the weight in ``block`` blocks."""
    _check_grid(weight, scale_inv, block)
    out, inp = weight.shape
    bo, bi = block
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out].repeat_interleave(bi, dim=1)[:, :inp]
    return weight.float() * scale


def _check_grid(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
    if weight.dim() != 2:
        raise ValueError(f"an FP8 block-scaled weight must be 2-D, got shape {tuple(weight.shape)}")
    grid = scale_grid(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"scale grid {tuple(scale_inv.shape)} does not cover a {weight.shape[0]}x{weight.shape[1]} "
                         f"weight in {block[0]}x{block[1]} blocks (expected {grid})")


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int],
                keep: Container[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream with every fp8 ``X.weight`` and its ``X.weight_scale_inv`` replaced by the dequantized fp32
    ``X.weight`` (in whichever order the two come); other tensors pass through. A pair whose ``X.weight`` is in
    ``keep`` passes through as it is (the weight, then its scales), its grid checked. Raises ValueError for an
    fp8 weight without its scales, or scales without their weight, once the stream ends."""
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
            dense = None if key in keep else dequantize_block_fp8(fp8, scale, block)
            if dense is None:
                _check_grid(fp8, scale, block)
        except ValueError as e:
            raise ValueError(f"{key}: {e}") from None
        if dense is not None:
            yield key, dense
        else:
            yield key, fp8
            yield key + SCALE_SUFFIX, scale
    if waiting:
        halves = sorted(k + (SCALE_SUFFIX if v.dtype != torch.float8_e4m3fn else "") for k, v in waiting.items())
        raise ValueError(f"FP8 tensors without their pair (weight + {SCALE_SUFFIX}): {halves[:4]}")
