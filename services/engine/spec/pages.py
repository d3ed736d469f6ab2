"""Pages with a draft region: uint8 ``[P, target region bytes + draft region bytes]``.

Region order and codecs follow the page layout (kv_layout.PageLayout.regions): the target region in
the codec asked for (the cache's own dtype, or fp8-e4m3 on the wire), then the draft region in the
draft codec (``--draft-kv-codec``). Each region is packed and restored by the same kernels
(kernels.pack_pages / pack_pages_fp8 and their torch references) as a single-region page.
"""

from __future__ import annotations

import torch

from services.engine.kv_layout import FP8_CODEC
from services.kernels import pack_pages, pack_pages_fp8, unpack_pages, unpack_pages_fp8


def _pack_region(cache: torch.Tensor, idx: torch.Tensor, fp8: bool) -> torch.Tensor:
    """uint8 [P, region bytes] of one cache [L, 2, NB, bs, kvh, hd]."""
    packed = pack_pages_fp8(cache, idx) if fp8 else pack_pages(cache, idx)
    return packed.contiguous().view(torch.uint8).reshape(idx.numel(), -1)


def _unpack_region(data: torch.Tensor, cache: torch.Tensor, idx: torch.Tensor, fp8: bool) -> None:
    """Inverse of _pack_region: data uint8 [P, region bytes] (a column slice is fine)."""
    data = data.contiguous()
    if fp8:
        unpack_pages_fp8(data, cache, idx)
        return
    page = (cache.shape[0], 2, *cache.shape[3:])
    unpack_pages(data.view(cache.dtype).view(idx.numel(), *page), cache, idx)


def region_nbytes(cache: torch.Tensor, fp8: bool) -> int:
    """Bytes one page of ``cache`` takes in its region (values + per-token-per-head fp32 scales for fp8)."""
    layers, _, _, bs, kvh, hd = cache.shape
    elems = layers * 2 * bs * kvh * hd
    return elems + layers * 2 * bs * kvh * 4 if fp8 else elems * cache.element_size()


def pack_composite(target: torch.Tensor, draft: torch.Tensor, block_ids: list[int], target_codec: str | None,
                   draft_codec: str) -> torch.Tensor:
    """Pages of ``block_ids`` from both caches as uint8 [P, page bytes], on the caches' device."""
    idx = torch.tensor(block_ids, dtype=torch.int64, device=target.device)
    return torch.cat([_pack_region(target, idx, target_codec == FP8_CODEC),
                      _pack_region(draft, idx, draft_codec == FP8_CODEC)], dim=1)


def unpack_composite(pages: torch.Tensor, target: torch.Tensor, draft: torch.Tensor, block_ids: list[int],
                     target_codec: str | None, draft_codec: str) -> None:
    """Write uint8 [P, page bytes] pages into both caches at ``block_ids`` (ValueError on a size mismatch)."""
    t_fp8, d_fp8 = target_codec == FP8_CODEC, draft_codec == FP8_CODEC
    tb, db = region_nbytes(target, t_fp8), region_nbytes(draft, d_fp8)
    pages = pages.reshape(len(block_ids), -1).view(torch.uint8)
    if pages.shape[1] != tb + db:
        raise ValueError(f"pages of {pages.shape[1]} bytes, the layout's are {tb} (target) + {db} (draft)")
    pages = pages.to(target.device, non_blocking=True)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=target.device)
    _unpack_region(pages[:, :tb], target, idx, t_fp8)
    _unpack_region(pages[:, tb:], draft, idx, d_fp8)
