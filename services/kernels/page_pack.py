"""Pack a list of KV blocks (all layers, K and V) into one contiguous transfer buffer, and back."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _page_pack_kernel(
    Cache_ptr,
    Buf_ptr,
    Ids_ptr,
    num_blocks,
    chunk,
    num_regions,
    TO_BUFFER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Flat copy of one BLOCK-element slice of one (page p, region r = layer * 2 + kv):

        Buf[(p * R + r) * C + i] <-> Cache[(r * NB + ids[p]) * C + i],  C = bs * kvh * hd, 0 <= i < C

    (cache -> buffer when TO_BUFFER, buffer -> cache otherwise), on an integer view of the bytes.
    """
    p = tl.program_id(0)
    r = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    blk = tl.load(Ids_ptr + p).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk
    cache_ptrs = Cache_ptr + (r * num_blocks + blk) * chunk + offs
    buf_ptrs = Buf_ptr + (p.to(tl.int64) * num_regions + r) * chunk + offs
    if TO_BUFFER:
        tl.store(buf_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
    else:
        tl.store(cache_ptrs, tl.load(buf_ptrs, mask=mask), mask=mask)


def _as_words(t: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, int]:
    """A flat integer view of contiguous t with the widest word (<= 4 bytes) dividing chunk_bytes."""
    for word, dtype in ((4, torch.int32), (2, torch.int16), (1, torch.uint8)):
        if chunk_bytes % word == 0 and t.numel() * t.element_size() % word == 0:
            return t.reshape(-1).view(torch.uint8).view(dtype), word
    raise AssertionError("unreachable")


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    assert kv_cache.dim() == 6 and kv_cache.shape[1] == 2, "kv_cache must be [L, 2, NB, bs, kvh, hd]"
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    assert block_ids.dim() == 1 and block_ids.dtype in (torch.int32, torch.int64), "block_ids int32/int64 [P]"
    assert block_ids.is_contiguous() and block_ids.device == kv_cache.device


def _launch(kv_cache: torch.Tensor, buffer: torch.Tensor, block_ids: torch.Tensor, to_buffer: bool) -> None:
    num_layers, _, num_blocks = kv_cache.shape[:3]
    chunk_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    cache_w, word = _as_words(kv_cache, chunk_bytes)
    buf_w, _ = _as_words(buffer, chunk_bytes)
    chunk = chunk_bytes // word
    grid = (block_ids.shape[0], num_layers * 2, triton.cdiv(chunk, _BLOCK))
    _page_pack_kernel[grid](
        cache_w,
        buf_w,
        block_ids,
        num_blocks,
        chunk,
        num_layers * 2,
        TO_BUFFER=to_buffer,
        BLOCK=_BLOCK,
        num_warps=8,
    )


def pack_pages(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Gather blocks -> buffer [P, L, 2, bs, kvh, hd] (kv_cache dtype), buffer[p, l, kv] = kv_cache[l, kv, ids[p]]."""
    _check(kv_cache, block_ids)
    shape = (block_ids.shape[0], kv_cache.shape[0], 2, *kv_cache.shape[3:])
    buffer = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    if block_ids.numel() > 0:
        _launch(kv_cache, buffer, block_ids, to_buffer=True)
    return buffer


def unpack_pages(buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Scatter buffer [P, L, 2, bs, kvh, hd] back: kv_cache[l, kv, ids[p]] = buffer[p, l, kv]."""
    _check(kv_cache, block_ids)
    shape = (block_ids.shape[0], kv_cache.shape[0], 2, *kv_cache.shape[3:])
    assert tuple(buffer.shape) == shape, f"buffer shape {tuple(buffer.shape)} != {shape}"
    assert buffer.dtype == kv_cache.dtype and buffer.is_contiguous() and buffer.device == kv_cache.device
    if block_ids.numel() > 0:
        _launch(kv_cache, buffer, block_ids, to_buffer=False)
