"""Behaviour every kvstore backend shares: embedded (memory, memory+disk) and Mooncake (real master)."""

from __future__ import annotations

import asyncio
import os

import pytest

from services.kvstore.backend import ChecksumMismatchError, InvalidKeyError, KVStoreBackend
from tests.kvstore.conftest import KiB, PageFactory, new_fp, new_hash


async def test_put_get_roundtrip(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(size) for size in (1, 4 * KiB, 40 * KiB, 100 * KiB)]
    for h, data, crc in pages:
        assert await backend.put(fp, h, data, crc) is True
    for h, data, _ in pages:
        assert await backend.get(fp, h) == data


async def test_lookup_counts_leading_present_pages(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(2 * KiB) for _ in range(5)]
    hashes = [h for h, _, _ in pages]
    for h, data, crc in pages[:3] + pages[4:]:  # page 3 missing
        await backend.put(fp, h, data, crc)
    assert await backend.lookup(fp, hashes) == 3
    assert await backend.lookup(fp, hashes[:2]) == 2
    assert await backend.lookup(fp, hashes[3:]) == 0  # stops at the first miss, even if later ones exist
    assert await backend.lookup(fp, []) == 0
    assert await backend.lookup(new_fp(), hashes) == 0  # the fingerprint is part of the key
    tiers = await backend.locate(fp, hashes)
    assert len(tiers) == 3
    assert set(tiers) <= {"memory", "disk", "mooncake"}


async def test_put_existing_is_skipped(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(3 * KiB)
    assert await backend.put(fp, h, data, crc) is True
    assert await backend.put(fp, h, data, crc) is False
    other = os.urandom(3 * KiB)
    from services.common.checksum import checksum

    assert await backend.put(fp, h, other, checksum(other)) is False
    assert await backend.get(fp, h) == data  # never overwritten


async def test_delete(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(1 * KiB) for _ in range(3)]
    for h, data, crc in pages:
        await backend.put(fp, h, data, crc)
    assert await backend.delete(fp, [pages[0][0], pages[1][0], new_hash()]) == 2
    assert await backend.get(fp, pages[0][0]) is None
    assert await backend.get(fp, pages[1][0]) is None
    assert await backend.get(fp, pages[2][0]) == pages[2][1]
    assert await backend.delete(fp, [pages[0][0]]) == 0
    # A deleted page can be stored again.
    assert await backend.put(fp, *pages[0]) is True


async def test_delete_layout(backend: KVStoreBackend, page: PageFactory) -> None:
    fp, other_fp = new_fp(), new_fp()
    mine = [page(1 * KiB) for _ in range(3)]
    theirs = page(1 * KiB)
    for p in mine:
        await backend.put(fp, *p)
    await backend.put(other_fp, *theirs)
    assert await backend.delete_layout(fp) == 3
    assert await backend.lookup(fp, [p[0] for p in mine]) == 0
    assert await backend.get(other_fp, theirs[0]) == theirs[1]


async def test_unknown_key_is_a_miss(backend: KVStoreBackend) -> None:
    before = sum(t.misses for t in backend.stats().tiers)
    assert await backend.get(new_fp(), new_hash()) is None
    assert sum(t.misses for t in backend.stats().tiers) > before


async def test_checksum_mismatch_rejected(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(2 * KiB)
    with pytest.raises(ChecksumMismatchError, match=r"checksum mismatch: sent crc32=0x[0-9a-f]{8}"):
        await backend.put(fp, h, data, crc ^ 1)
    assert await backend.lookup(fp, [h]) == 0
    assert await backend.get(fp, h) is None


@pytest.mark.parametrize(("fp", "h", "match"), [
    ("abc", bytes(16), "fingerprint must be 16 lower-case hex"),
    ("ZZZZZZZZZZZZZZZZ", bytes(16), "fingerprint"),
    ("0123456789abcdef", bytes(15), "block hash must be 16 bytes, got 15"),
])
async def test_invalid_keys_rejected(backend: KVStoreBackend, fp: str, h: bytes, match: str) -> None:
    with pytest.raises(InvalidKeyError, match=match):
        await backend.put(fp, h, b"x", 0)
    with pytest.raises(InvalidKeyError, match=match):
        await backend.get(fp, h)
    with pytest.raises(InvalidKeyError, match=match):
        await backend.lookup(fp, [h])


async def test_concurrent_puts_and_gets(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(8 * KiB) for _ in range(24)]
    stored = await asyncio.gather(*(backend.put(fp, *p) for p in pages + pages))
    assert sum(stored) == len(pages)  # each page stored exactly once, the duplicate skipped
    got = await asyncio.gather(*(backend.get(fp, h) for h, _, _ in pages))
    for (_, data, _), g in zip(pages, got, strict=True):
        assert g is None or g == data  # a cache may drop pages, never corrupt them
    assert sum(g is not None for g in got) >= len(pages) // 2


async def test_stats_shape(backend: KVStoreBackend, page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(1 * KiB)
    await backend.put(fp, h, data, crc)
    await backend.get(fp, h)
    stats = backend.stats()
    assert stats.tiers and stats.tiers[0].name in {"memory", "mooncake"}
    assert sum(t.hits for t in stats.tiers) >= 1
    d = stats.to_dict()
    assert set(d["tiers"][stats.tiers[0].name]) >= {"bytes", "entries", "hits", "misses", "evictions", "corrupt"}
