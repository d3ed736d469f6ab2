"""Pages of several regions: uint8 ``[P, bytes of region 0 + bytes of region 1 + ...]``.

A page's regions and their order follow the page layout (kv_layout.PageLayout.regions): the target region (the
model's K/V, or latent), then DeepSeek-V3.2's index keys (index_keys.py), then speculative decoding's draft KV.
Each region here is the pool that holds it and knows its own bytes (``nbytes`` / ``pack`` / ``unpack``), so
``pack_regions`` / ``unpack_regions`` move any list of them by that description. The target region is packed in the
codec the call asks for (the cache's own dtype, or fp8-e4m3 on the wire); that wire codec never re-encodes another
region: a draft region keeps its draft codec (``--draft-kv-codec``), the index keys the codec they are stored in
(``--index-kv-codec``, copied as bytes). K/V regions go through the same kernels (kernels.pack_pages /
pack_pages_fp8 and their torch references) as a single-region page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from services.engine.kv_layout import FP8_CODEC
from services.kernels import pack_pages, pack_pages_fp8, unpack_pages, unpack_pages_fp8


class PageRegion(Protocol):
    """One region of every page, held by a pool with the target pool's block ids."""

    kind: str
    """"target", "index" or "draft" (kv_layout.Region.kind)."""

    @property
    def device(self) -> torch.device:
        """The pool's device (pages are packed and unpacked there)."""
        ...

    def nbytes(self, codec: str | None = None) -> int:
        """Bytes of one page of the region (``codec``: the target's wire codec; other regions ignore it)."""
        ...

    def pack(self, idx: torch.Tensor, codec: str | None = None) -> torch.Tensor:
        """uint8 [P, nbytes] of the blocks ``idx`` (int64, the pool's device)."""
        ...

    def unpack(self, data: torch.Tensor, idx: torch.Tensor, codec: str | None = None) -> None:
        """Write uint8 [P, nbytes] (a column slice is fine) into the blocks ``idx``."""
        ...


class KVRegion:
    """A region held as a K/V cache [L, 2, NB, bs, kvh, hd]: the target's (packed in the codec each call asks
    for) or the draft's (always in its own codec)."""

    def __init__(self, kind: str, cache: torch.Tensor, codec: str | None = None) -> None:
        self.kind = kind
        self.cache = cache
        self.codec = codec
        """The region's fixed codec (the draft's); None: the call's (the target's: native or fp8 on the wire)."""

    @property
    def device(self) -> torch.device:
        return self.cache.device

    def _fp8(self, codec: str | None) -> bool:
        return (self.codec if self.codec is not None else codec) == FP8_CODEC

    def nbytes(self, codec: str | None = None) -> int:
        layers, _, _, bs, kvh, hd = self.cache.shape
        elems = layers * 2 * bs * kvh * hd
        return elems + layers * 2 * bs * kvh * 4 if self._fp8(codec) else elems * self.cache.element_size()

    def pack(self, idx: torch.Tensor, codec: str | None = None) -> torch.Tensor:
        packed = pack_pages_fp8(self.cache, idx) if self._fp8(codec) else pack_pages(self.cache, idx)
        return packed.contiguous().view(torch.uint8).reshape(idx.numel(), -1)

    def unpack(self, data: torch.Tensor, idx: torch.Tensor, codec: str | None = None) -> None:
        data = data.contiguous()
        if self._fp8(codec):
            unpack_pages_fp8(data, self.cache, idx)
            return
        page = (self.cache.shape[0], 2, *self.cache.shape[3:])
        unpack_pages(data.view(self.cache.dtype).view(idx.numel(), *page), self.cache, idx)


def regions_nbytes(regions: Sequence[PageRegion], target_codec: str | None) -> int:
    """Bytes of one page of every region, the target's in ``target_codec`` (None: the cache's dtype)."""
    return sum(r.nbytes(target_codec) for r in regions)


def pack_regions(regions: Sequence[PageRegion], block_ids: list[int] | torch.Tensor, target_codec: str | None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Pages of ``block_ids`` (a list, or int64 ids on the pools' device) from every region as uint8 [P, page
    bytes], on the pools' device, or into ``out`` (uint8 [P, page bytes] on that device)."""
    idx = block_ids if isinstance(block_ids, torch.Tensor) else \
        torch.tensor(block_ids, dtype=torch.int64, device=regions[0].device)
    parts = [r.pack(idx, target_codec) for r in regions]
    return torch.cat(parts, dim=1) if out is None else torch.cat(parts, dim=1, out=out)


def unpack_regions(pages: torch.Tensor, regions: Sequence[PageRegion], block_ids: list[int],
                   target_codec: str | None) -> None:
    """Write uint8 [P, page bytes] pages into every region at ``block_ids`` (ValueError on a size mismatch)."""
    sizes = [r.nbytes(target_codec) for r in regions]
    pages = pages.reshape(len(block_ids), -1).view(torch.uint8)
    if pages.shape[1] != sum(sizes):
        named = " + ".join(f"{n} ({r.kind})" for n, r in zip(sizes, regions, strict=True))
        raise ValueError(f"pages of {pages.shape[1]} bytes, the layout's are {named}")
    device = regions[0].device
    pages = pages.to(device, non_blocking=True)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=device)
    start = 0
    for r, n in zip(regions, sizes, strict=True):
        r.unpack(pages[:, start:start + n], idx, target_codec)
        start += n
