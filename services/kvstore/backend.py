"""The kvstore backend interface, its key rules, errors and per-tier counters.

A key is (layout fingerprint, chained block hash): a 16-hex-char string and 16 bytes. A value is one
packed KV page with its CRC-32 (``services.common.checksum``). Backends are caches: a lost,
evicted, truncated or corrupt page is a miss (and a counter), never wrong bytes and never an exception
to the caller of ``get``/``lookup``.

Every method is a coroutine; implementations run disk I/O, CRCs of large pages and blocking native
calls in worker threads (``asyncio.to_thread``), never on the event loop.
"""

from __future__ import annotations

import abc
import asyncio
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from services.common.block_hash import HASH_SIZE
from services.common.checksum import checksum
from services.common.kvstore_pages import key_str

FINGERPRINT_CHARS = 16
"""Characters in a layout fingerprint (lower-case hex)."""
_HEX = frozenset(string.hexdigits.lower())

Key = tuple[str, bytes]
"""(layout fingerprint, block hash)."""


class KVStoreError(Exception):
    """Base of the errors a backend raises for bad input (never for a miss)."""


class InvalidKeyError(KVStoreError, ValueError):
    """The fingerprint is not 16 lower-case hex chars or the hash is not 16 bytes."""


class ChecksumMismatchError(KVStoreError, ValueError):
    """put() was given bytes whose CRC-32 is not the checksum sent with them."""

    def __init__(self, fp: str, h: bytes, expected: int, got: int, size: int) -> None:
        super().__init__(f"page {key_str(fp, h)}: checksum mismatch: sent crc32=0x{expected:08x}, "
                         f"payload ({size} bytes) has crc32=0x{got:08x}")
        self.expected = expected
        self.got = got


class PageTooLargeError(KVStoreError, ValueError):
    """The page is larger than every tier's byte budget, so no tier can hold it."""

    def __init__(self, fp: str, h: bytes, size: int, limit: int) -> None:
        super().__init__(f"page {key_str(fp, h)}: {size} bytes is larger than the largest tier "
                         f"budget ({limit} bytes)")
        self.size = size
        self.limit = limit


def fingerprint_problem(fp: str) -> str | None:
    """Why ``fp`` is not a layout fingerprint, or None when it is one."""
    if len(fp) != FINGERPRINT_CHARS or not set(fp) <= _HEX:
        return f"must be {FINGERPRINT_CHARS} lower-case hex characters, got {fp!r}"
    return None


def hash_problem(h: bytes) -> str | None:
    """Why ``h`` is not a block hash, or None when it is one."""
    if len(h) != HASH_SIZE:
        return f"must be {HASH_SIZE} bytes, got {len(h)} bytes ({h[:32].hex()})"
    return None


def validate_key(fp: str, hashes: Sequence[bytes] | bytes) -> None:
    """Raise InvalidKeyError unless ``fp`` and every hash are well formed."""
    problem = fingerprint_problem(fp)
    if problem is not None:
        raise InvalidKeyError(f"layout fingerprint {problem}")
    for h in [hashes] if isinstance(hashes, bytes) else hashes:
        problem = hash_problem(h)
        if problem is not None:
            raise InvalidKeyError(f"block hash {problem}")


def verify_checksum(fp: str, h: bytes, data: bytes | memoryview, expected: int) -> None:
    """Raise ChecksumMismatchError unless crc32(data) == expected."""
    got = checksum(data)
    if got != expected:
        raise ChecksumMismatchError(fp, h, expected, got, len(data))


@dataclass
class TierStats:
    """Counters of one storage tier since the store started (units in each name's docstring)."""

    name: str
    """"memory", "disk" or "mooncake"."""
    capacity_bytes: int = 0
    """Byte budget; 0 means unbounded or unknown."""
    bytes: int = 0
    """Payload bytes held now."""
    entries: int = 0
    """Pages held now."""
    hits: int = 0
    """get() calls answered by this tier (pages)."""
    misses: int = 0
    """get() calls this tier could not answer (pages)."""
    evictions: int = 0
    """Pages dropped to stay within the byte budget (pages; spills to a lower tier included)."""
    corrupt: int = 0
    """Pages found truncated or failing their CRC, dropped and never served (pages)."""
    errors: int = 0
    """Backend failures (I/O errors, unreachable master) turned into misses or skipped puts."""


@dataclass
class StoreStats:
    """Per-tier counters, fastest tier first."""

    backend: str
    tiers: list[TierStats] = field(default_factory=list)

    def tier(self, name: str) -> TierStats:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; tiers: {[t.name for t in self.tiers]}")

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "tiers": {t.name: asdict(t) for t in self.tiers}}


class KVStoreBackend(abc.ABC):
    """Content-addressed KV page store. Keys are validated by every method (InvalidKeyError)."""

    name: str = "abstract"

    @abc.abstractmethod
    async def locate(self, fp: str, hashes: Sequence[bytes]) -> list[str]:
        """Tier names of the leading present pages of ``hashes`` (stops at the first miss)."""

    async def lookup(self, fp: str, hashes: Sequence[bytes]) -> int:
        """How many leading pages of ``hashes`` are present (stops at the first miss)."""
        return len(await self.locate(fp, hashes))

    @abc.abstractmethod
    async def get(self, fp: str, h: bytes) -> bytes | None:
        """The page's bytes, verified; None on a miss (absent, evicted, lost or corrupt)."""

    async def get_page(self, fp: str, h: bytes) -> tuple[bytes, int] | None:
        """(bytes, crc32) of a verified page, or None. Backends that keep the CRC avoid recomputing it."""
        data = await self.get(fp, h)
        if data is None:
            return None
        return data, await asyncio.to_thread(checksum, data)

    @abc.abstractmethod
    async def put(self, fp: str, h: bytes, data: bytes, crc: int) -> bool:
        """Store a page. False when it is present already (or the store could not take it; counted).

        Raises ChecksumMismatchError if crc32(data) != crc and PageTooLargeError if no tier can hold it.
        """

    @abc.abstractmethod
    async def delete(self, fp: str, hashes: Sequence[bytes]) -> int:
        """Remove pages; returns how many were present."""

    @abc.abstractmethod
    async def delete_layout(self, fp: str) -> int:
        """Remove every page of layout ``fp``; returns how many were present."""

    @abc.abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the per-tier counters."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (the embedded store flushes its memory tier to disk)."""
