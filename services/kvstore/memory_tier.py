"""In-memory LRU tier with a hard byte budget (not thread-safe: the embedded store locks around it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from services.kvstore.backend import Key, TierStats

Page = tuple[bytes, int]
"""(payload, crc32)."""


class MemoryTier:
    """Pages in an OrderedDict, least recently used first. ``bytes`` never exceeds ``capacity``."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"memory tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self._pages: OrderedDict[Key, Page] = OrderedDict()
        self.stats = TierStats(name="memory", capacity_bytes=capacity_bytes)

    def __contains__(self, key: Key) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def keys(self) -> Iterator[Key]:
        return iter(list(self._pages))

    def get(self, key: Key) -> Page | None:
        """(payload, crc) marked most recently used, or None. Counts a hit or a miss."""
        page = self._pages.get(key)
        if page is None:
            self.stats.misses += 1
            return None
        self._pages.move_to_end(key)
        self.stats.hits += 1
        return page

    def fits(self, size: int) -> bool:
        return size <= self.capacity

    def put(self, key: Key, data: bytes, crc: int) -> list[tuple[Key, Page]] | None:
        """Insert ``data`` as most recently used, evicting LRU pages until it fits.

        Returns the evicted pages (for spilling to a lower tier), or None when the page is larger than
        the whole budget (nothing stored, nothing evicted). An existing key is replaced.
        """
        size = len(data)
        if not self.fits(size):
            return None
        self.pop(key)
        evicted: list[tuple[Key, Page]] = []
        while self.stats.bytes + size > self.capacity:
            old_key, old = self._pages.popitem(last=False)
            self.stats.bytes -= len(old[0])
            self.stats.evictions += 1
            evicted.append((old_key, old))
        self._pages[key] = (data, crc)
        self.stats.bytes += size
        self.stats.entries = len(self._pages)
        return evicted

    def pop(self, key: Key) -> Page | None:
        """Remove a page (not counted as an eviction); returns it or None."""
        page = self._pages.pop(key, None)
        if page is not None:
            self.stats.bytes -= len(page[0])
            self.stats.entries = len(self._pages)
        return page

    def drain(self) -> list[tuple[Key, Page]]:
        """Remove and return every page, least recently used first."""
        pages = list(self._pages.items())
        self._pages.clear()
        self.stats.bytes = 0
        self.stats.entries = 0
        return pages
