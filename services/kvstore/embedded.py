"""The embedded backend (default): a memory LRU tier spilling into an optional disk tier.

- put: verify the CRC, store in memory (pages larger than the memory budget go straight to disk); the
  pages memory evicts are written to disk (``spilled``) so they stay servable.
- get: memory, else disk (CRC-verified there); disk hits are promoted to memory, the disk copy stays.
- close: the memory tier is flushed to disk so a graceful restart keeps every page.

Memory pages were CRC-checked on put and are immutable ``bytes``; they are served without a re-check.
Index operations happen under one lock on the event loop thread; disk I/O and CRCs of large pages run
in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence

from services.kvstore.backend import (
    Key,
    KVStoreBackend,
    PageTooLargeError,
    StoreStats,
    TierStats,
    validate_key,
    verify_checksum,
)
from services.kvstore.disk_tier import HEADER_SIZE, DiskTier
from services.kvstore.memory_tier import MemoryTier, Page

log = logging.getLogger(__name__)

INLINE_CRC_BYTES = 256 * 1024
"""Pages up to this size are CRC-checked on the event loop; larger ones in a worker thread (bytes)."""


class EmbeddedBackend(KVStoreBackend):
    """Memory tier (``memory_bytes``) over an optional disk tier (``disk_dir``, ``disk_bytes``)."""

    name = "embedded"

    def __init__(self, memory_bytes: int, disk_dir: str | os.PathLike[str] | None = None,
                 disk_bytes: int = 0) -> None:
        self._memory = MemoryTier(memory_bytes)
        self._disk: DiskTier | None = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
        self._lock = threading.Lock()
        # Pages evicted from memory whose disk write is in flight: still served from here meanwhile.
        self._spilling: dict[Key, Page] = {}

    @property
    def max_page_bytes(self) -> int:
        """Largest page some tier can hold (bytes)."""
        disk = self._disk.capacity - HEADER_SIZE if self._disk is not None else 0
        return max(self._memory.capacity, disk)

    def _in_memory(self, key: Key) -> bool:
        return key in self._memory or key in self._spilling

    # -- interface ------------------------------------------------------------------------------------
    async def locate(self, fp: str, hashes: Sequence[bytes]) -> list[str]:
        validate_key(fp, hashes)
        tiers: list[str] = []
        with self._lock:
            for h in hashes:
                key = (fp, h)
                if self._in_memory(key):
                    tiers.append("memory")
                elif self._disk is not None and key in self._disk:
                    tiers.append("disk")
                else:
                    break
        return tiers

    async def get(self, fp: str, h: bytes) -> bytes | None:
        page = await self.get_page(fp, h)
        return page[0] if page is not None else None

    async def get_page(self, fp: str, h: bytes) -> tuple[bytes, int] | None:
        validate_key(fp, h)
        key = (fp, h)
        with self._lock:
            page = self._memory.get(key)
            if page is None and key in self._spilling:
                page = self._spilling[key]
                self._memory.stats.misses -= 1  # still in RAM: a memory hit after all
                self._memory.stats.hits += 1
        if page is not None or self._disk is None:
            return page
        page = await asyncio.to_thread(self._disk.get, key)
        if page is not None and self._memory.fits(len(page[0])):
            await self._insert_memory(key, *page)
        return page

    async def put(self, fp: str, h: bytes, data: bytes, crc: int) -> bool:
        validate_key(fp, h)
        if len(data) > self.max_page_bytes:
            raise PageTooLargeError(fp, h, len(data), self.max_page_bytes)
        if len(data) > INLINE_CRC_BYTES:
            await asyncio.to_thread(verify_checksum, fp, h, data, crc)
        else:
            verify_checksum(fp, h, data, crc)
        key = (fp, h)
        if self._memory.fits(len(data)):
            return await self._insert_memory(key, data, crc, only_if_absent=True)
        assert self._disk is not None  # max_page_bytes guarantees a tier fits
        with self._lock:
            if self._in_memory(key):
                return False
        return await asyncio.to_thread(self._disk.put, key, data, crc)

    async def delete(self, fp: str, hashes: Sequence[bytes]) -> int:
        validate_key(fp, hashes)
        keys = [(fp, h) for h in hashes]
        with self._lock:
            present = {k for k in keys if self._memory.pop(k) is not None or self._spilling.pop(k, None)}
        if self._disk is not None:
            present |= {k for k in keys if k in self._disk}
            await asyncio.to_thread(self._disk.delete, keys)
        return len(present)

    async def delete_layout(self, fp: str) -> int:
        validate_key(fp, [])
        with self._lock:
            keys = {k for k in self._memory.keys() if k[0] == fp}
            keys |= {k for k in self._spilling if k[0] == fp}
            for k in keys:
                self._memory.pop(k)
                self._spilling.pop(k, None)
        if self._disk is None:
            return len(keys)
        disk_keys = await asyncio.to_thread(self._disk.delete_layout, fp)
        return len(keys | set(disk_keys))

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = [TierStats(**vars(self._memory.stats))]
        if self._disk is not None:
            tiers.append(self._disk.snapshot())
        return StoreStats(backend=self.name, tiers=tiers)

    async def close(self) -> None:
        """Flush the memory tier to disk (a graceful restart keeps every page)."""
        if self._disk is None:
            return
        with self._lock:
            pages = self._memory.drain()
        if pages:
            await self._spill(pages)
            log.info("kvstore: flushed %d memory pages to %s", len(pages), self._disk.root)

    # -- memory insertion and spilling ----------------------------------------------------------------
    async def _insert_memory(self, key: Key, data: bytes, crc: int, *,
                             only_if_absent: bool = False) -> bool:
        with self._lock:
            if only_if_absent and (self._in_memory(key) or (self._disk is not None and key in self._disk)):
                return False
            if key in self._memory:
                return False
            evicted = self._memory.put(key, data, crc)
            if evicted is None:
                return False
            if self._disk is not None:
                for k, page in evicted:
                    self._spilling[k] = page
        if evicted and self._disk is not None:
            await self._spill(evicted)
        return True

    async def _spill(self, pages: list[tuple[Key, Page]]) -> None:
        try:
            await asyncio.to_thread(self._spill_sync, pages)
        finally:
            with self._lock:
                for k, page in pages:
                    if self._spilling.get(k) is page:
                        del self._spilling[k]

    def _spill_sync(self, pages: list[tuple[Key, Page]]) -> None:
        assert self._disk is not None
        for key, (data, crc) in pages:
            if key in self._disk or not self._disk.fits(len(data)):
                continue  # promoted from disk (the copy is still there), or too large for it
            self._disk.put(key, data, crc)
