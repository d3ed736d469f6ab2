"""FP8-e4m3 KV codec: per-token-per-head scales, for K/V tensors and for fp8 transfer pages.

Page layout (kernels.fp8_layout): fp8 values [L, 2, bs, kvh, hd] then fp32 scales [L, 2, bs, kvh].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.kernels._triton_utils import interpret_mode
from services.kernels.fp8_layout import FP8_E4M3_MAX, fp8_layout_codec_name, fp8_page_nbytes, fp8_page_regions

FP8_DTYPE = torch.float8_e4m3fn
_ROWS = 32

__all__ = [
    "fp8_dequantize",
    "fp8_layout_codec_name",
    "fp8_page_nbytes",
    "fp8_quantize",
    "pack_pages_fp8",
    "unpack_pages_fp8",
]


@triton.jit
def _round_to_e4m3_grid(y):
    """Round-to-nearest-even of fp32 y (|y| <= 448) onto the e4m3 grid, kept in fp32.

    Spacing is 2^(e - 3) for exponent e >= -6 and 2^-9 below (subnormals). Used under the interpreter,
    whose fp32 -> fp8 cast drops the carry when rounding crosses a power of two (124.3 -> 64).
    """
    bits = y.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)
    ulp = ((exp - 3) << 23).to(tl.float32, bitcast=True)
    t = tl.abs(y) / ulp
    r = tl.floor(t + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    r = tl.where(((r - t) == 0.5) & odd, r - 1.0, r)
    return tl.where(y < 0.0, -r * ulp, r * ulp)


@triton.jit
def _quantize_rows(x, FP8_MAX: tl.constexpr, GRID_ROUND: tl.constexpr):
    """Rows of x [R, D] (fp32) -> (fp8 values, fp32 scale [R]) with scale = amax / FP8_MAX."""
    amax = tl.max(tl.abs(x), 1)
    # div_rn: IEEE division, so scales and codes match the torch reference bit for bit.
    scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))
    safe = tl.where(scale > 0.0, scale, 1.0)
    y = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if GRID_ROUND:
        y = _round_to_e4m3_grid(y)
    return y.to(tl.float8e4nv), scale


@triton.jit
def _row_tile(num_rows, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr):
    """This program's BLOCK rows of a [num_rows, HEAD_DIM] tile: (row ids as int64, column ids [BLOCK_D],
    row mask [BLOCK], element mask [BLOCK, BLOCK_D])."""
    offs_r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_rows
    return offs_r.to(tl.int64), offs_d, mask_r, mask_r[:, None] & (offs_d[None, :] < HEAD_DIM)


@triton.jit
def _fp8_quantize_kernel(
    X_ptr,
    Q_ptr,
    S_ptr,
    num_rows,
    stride_xt,
    stride_xh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    """Row r = t * kvh + h of X [T, kvh, hd]:  S[r] = max_d |X[t, h, d]| / 448,  Q[r, d] = fp8(X[t, h, d] / S[r])."""
    r64, offs_d, mask_r, mask = _row_tile(num_rows, HEAD_DIM, BLOCK_D, BLOCK)
    t = r64 // NUM_HEADS
    h = r64 % NUM_HEADS
    x = tl.load(
        X_ptr + t[:, None] * stride_xt + h[:, None] * stride_xh + offs_d[None, :], mask=mask, other=0.0
    )
    q, scale = _quantize_rows(x.to(tl.float32), FP8_MAX, GRID_ROUND)
    tl.store(Q_ptr + r64[:, None] * HEAD_DIM + offs_d[None, :], q, mask=mask)
    tl.store(S_ptr + r64, scale, mask=mask_r)


@triton.jit
def _fp8_dequantize_kernel(
    Q_ptr,
    S_ptr,
    X_ptr,
    num_rows,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """X[r, d] = float(Q[r, d]) * S[r] for contiguous Q [R, hd], S [R], X [R, hd]."""
    r64, offs_d, mask_r, mask = _row_tile(num_rows, HEAD_DIM, BLOCK_D, BLOCK)
    q = tl.load(Q_ptr + r64[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S_ptr + r64, mask=mask_r, other=0.0)
    tl.store(
        X_ptr + r64[:, None] * HEAD_DIM + offs_d[None, :],
        (q * s[:, None]).to(X_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _fp8_page_pack_kernel(
    Cache_ptr,
    Val_ptr,
    Scale_ptr,
    Ids_ptr,
    num_blocks,
    rows_per_region,
    num_regions,
    page_bytes,
    scale_offset,
    TO_BUFFER: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    GRID_ROUND: tl.constexpr,
):
    """Rows i of region r = layer * 2 + kv of page p (a row = one token's one head, hd values):

        x = Cache[r, ids[p], i]   (i over bs * kvh rows)
        Val[p * page_bytes + (r * RR + i) * hd + d] = fp8(x[d] / s),  Scale[p * page_bytes / 4 + scale_offset + r * RR + i] = s

    with s = amax|x| / 448 (TO_BUFFER); otherwise Cache[r, ids[p], i] = Val * s in the cache dtype.
    """
    p = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1).to(tl.int64)
    offs_i = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    mask_i = offs_i < rows_per_region
    mask = mask_i[:, None] & (offs_d[None, :] < HEAD_DIM)
    blk = tl.load(Ids_ptr + p).to(tl.int64)
    row_c = (r * num_blocks + blk) * rows_per_region + offs_i
    row_b = r * rows_per_region + offs_i
    cache_ptrs = Cache_ptr + row_c[:, None] * HEAD_DIM + offs_d[None, :]
    val_ptrs = Val_ptr + p * page_bytes + row_b[:, None] * HEAD_DIM + offs_d[None, :]
    scale_ptrs = Scale_ptr + p * (page_bytes // 4) + scale_offset + row_b
    if TO_BUFFER:
        x = tl.load(cache_ptrs, mask=mask, other=0.0).to(tl.float32)
        q, scale = _quantize_rows(x, FP8_MAX, GRID_ROUND)
        tl.store(val_ptrs, q, mask=mask)
        tl.store(scale_ptrs, scale, mask=mask_i)
    else:
        q = tl.load(val_ptrs, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(scale_ptrs, mask=mask_i, other=0.0)
        tl.store(cache_ptrs, (q * s[:, None]).to(Cache_ptr.dtype.element_ty), mask=mask)


def _row_block(head_dim: int) -> int:
    return max(1, min(_ROWS, 4096 // triton.next_power_of_2(head_dim)))


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, kvh, hd] (bf16/fp16/fp32) -> (fp8-e4m3 values [T, kvh, hd], fp32 scales [T, kvh])."""
    assert x.dim() == 3 and x.stride(-1) == 1, "x must be [T, kvh, hd] with contiguous head_dim"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {x.dtype}"
    num_tokens, num_heads, head_dim = x.shape
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=x.device)
    rows = num_tokens * num_heads
    if rows == 0:
        return q, scales
    block = _row_block(head_dim)
    _fp8_quantize_kernel[(triton.cdiv(rows, block),)](
        x,
        q,
        scales,
        rows,
        x.stride(0),
        x.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK=block,
        FP8_MAX=FP8_E4M3_MAX,
        GRID_ROUND=interpret_mode(),
        num_warps=4,
    )
    return q, scales


def fp8_dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q fp8 [T, kvh, hd], scales fp32 [T, kvh] -> [T, kvh, hd] in dtype."""
    assert q.dim() == 3 and q.dtype == FP8_DTYPE and q.is_contiguous()
    assert scales.shape == q.shape[:2] and scales.dtype == torch.float32 and scales.is_contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    rows = q.shape[0] * q.shape[1]
    if rows == 0:
        return out
    head_dim = q.shape[2]
    block = _row_block(head_dim)
    _fp8_dequantize_kernel[(triton.cdiv(rows, block),)](
        q,
        scales,
        out,
        rows,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK=block,
        num_warps=4,
    )
    return out


def _launch_pages(
    kv_cache: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor, to_buffer: bool
) -> None:
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    values_nbytes, _ = fp8_page_regions(num_layers, block_size, num_kv_heads, head_dim)
    page_bytes = buffer.shape[1]
    rows = block_size * num_kv_heads
    block = _row_block(head_dim)
    grid = (block_ids.shape[0], num_layers * 2, triton.cdiv(rows, block))
    _fp8_page_pack_kernel[grid](
        kv_cache,
        buffer.view(FP8_DTYPE),
        buffer.view(torch.float32),
        block_ids,
        num_blocks,
        rows,
        num_layers * 2,
        page_bytes,
        values_nbytes // 4,
        TO_BUFFER=to_buffer,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK=block,
        FP8_MAX=FP8_E4M3_MAX,
        GRID_ROUND=interpret_mode(),
        num_warps=4,
    )


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> int:
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "kv_cache must be [L, 2, NB, bs, kvh, hd]"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert kv_cache.dtype in (torch.bfloat16, torch.float16, torch.float32), (
        f"unsupported dtype {kv_cache.dtype}"
    )
    assert block_ids.dim() == 1 and block_ids.dtype in (torch.int32, torch.int64), "block_ids int32/int64 [P]"
    assert block_ids.is_contiguous() and block_ids.device == kv_cache.device
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return fp8_page_nbytes(num_layers, block_size, num_kv_heads, head_dim)


def pack_pages_fp8(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Quantize blocks into fp8 pages -> uint8 buffer [P, fp8_page_nbytes(L, bs, kvh, hd)]."""
    page_bytes = _check(kv_cache, block_ids)
    buffer = torch.empty((block_ids.shape[0], page_bytes), dtype=torch.uint8, device=kv_cache.device)
    if block_ids.numel() > 0:
        _launch_pages(kv_cache, buffer, block_ids, to_buffer=True)
    return buffer


def unpack_pages_fp8(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Dequantize fp8 pages (uint8 [P, page_bytes]) into kv_cache[l, kv, ids[p]] in the cache dtype."""
    page_bytes = _check(kv_cache, block_ids)
    assert buffer.dtype == torch.uint8 and buffer.is_contiguous() and buffer.device == kv_cache.device
    assert tuple(buffer.shape) == (block_ids.shape[0], page_bytes), (
        f"buffer shape {tuple(buffer.shape)} != {(block_ids.shape[0], page_bytes)}"
    )
    if block_ids.numel() > 0:
        _launch_pages(kv_cache, buffer, block_ids, to_buffer=False)
