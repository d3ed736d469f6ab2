"""Embedded backend: byte budgets, spilling and promotion, restart survival, corrupt/truncated files."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from services.common.checksum import checksum
from services.kvstore.backend import PageTooLargeError
from services.kvstore.disk_tier import HEADER_SIZE, DiskTier
from services.kvstore.embedded import EmbeddedBackend
from tests.kvstore.conftest import KiB, MiB, PageFactory, new_fp


def _assert_within_budget(b: EmbeddedBackend) -> None:
    for t in b.stats().tiers:
        assert 0 <= t.bytes <= t.capacity_bytes, t


async def test_byte_budgets_never_exceeded_under_fill(tmp_path: Path, page: PageFactory) -> None:
    b = EmbeddedBackend(memory_bytes=200 * KiB, disk_dir=tmp_path, disk_bytes=1 * MiB)
    rng = random.Random(7)
    fp = new_fp()
    stored = []
    for _ in range(120):
        p = page(rng.choice([1, 5 * KiB, 30 * KiB, 90 * KiB, 199 * KiB, 300 * KiB]))
        assert await b.put(fp, *p)
        stored.append(p)
        _assert_within_budget(b)
        # The disk tier's files really are within budget too.
        assert sum(f.stat().st_size for f in _page_files(tmp_path)) <= 1 * MiB
    stats = b.stats()
    assert stats.tier("memory").evictions > 0 and stats.tier("disk").evictions > 0
    # Recent pages survive, evicted ones are misses, nothing is ever wrong.
    for h, data, _ in stored:
        got = await b.get(fp, h)
        assert got is None or got == data
        _assert_within_budget(b)
    assert await b.get(fp, stored[-1][0]) == stored[-1][1]


async def test_memory_only_budget_and_lru(page: PageFactory) -> None:
    b = EmbeddedBackend(memory_bytes=10 * KiB)
    fp = new_fp()
    pages = [page(3 * KiB) for _ in range(3)]
    for p in pages:
        await b.put(fp, *p)
    assert await b.get(fp, pages[0][0]) == pages[0][1]  # page 0 now most recently used
    extra = page(3 * KiB)
    await b.put(fp, *extra)  # evicts page 1, the least recently used
    assert await b.lookup(fp, [pages[0][0]]) == 1
    assert await b.lookup(fp, [pages[1][0]]) == 0
    assert b.stats().tier("memory").evictions == 1
    assert b.stats().tier("memory").bytes == 9 * KiB
    with pytest.raises(PageTooLargeError, match=r"10241 bytes is larger than the largest tier budget \(10240"):
        await b.put(fp, *page(10 * KiB + 1))
    assert [t.name for t in b.stats().tiers] == ["memory"]


async def test_large_pages_bypass_memory_and_oversize_rejected(tmp_path: Path, page: PageFactory) -> None:
    b = EmbeddedBackend(memory_bytes=64 * KiB, disk_dir=tmp_path, disk_bytes=512 * KiB)
    fp = new_fp()
    big = page(200 * KiB)
    assert await b.put(fp, *big)
    assert await b.locate(fp, [big[0]]) == ["disk"]
    assert await b.get(fp, big[0]) == big[1]
    assert b.stats().tier("memory").bytes == 0  # too large to promote
    with pytest.raises(PageTooLargeError):
        await b.put(fp, *page(512 * KiB - HEADER_SIZE + 1))
    assert await b.put(fp, *page(512 * KiB - HEADER_SIZE))  # exactly fills the disk budget
    _assert_within_budget(b)


async def test_spill_then_promote(tmp_path: Path, page: PageFactory) -> None:
    b = EmbeddedBackend(memory_bytes=8 * KiB, disk_dir=tmp_path, disk_bytes=1 * MiB)
    fp = new_fp()
    first, second = page(6 * KiB), page(6 * KiB)
    await b.put(fp, *first)
    await b.put(fp, *second)  # first spills to disk
    assert await b.locate(fp, [second[0], first[0]]) == ["memory", "disk"]
    assert await b.get(fp, first[0]) == first[1]  # disk hit, promoted (second spills)
    assert await b.locate(fp, [first[0], second[0]]) == ["memory", "disk"]
    stats = b.stats()
    assert stats.tier("disk").hits == 1 and stats.tier("memory").misses == 1


async def test_restart_survival(tmp_path: Path, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(20 * KiB) for _ in range(10)]
    b = EmbeddedBackend(memory_bytes=64 * KiB, disk_dir=tmp_path, disk_bytes=4 * MiB)
    for p in pages:
        await b.put(fp, *p)
    await b.close()  # flushes memory to disk
    b2 = EmbeddedBackend(memory_bytes=64 * KiB, disk_dir=tmp_path, disk_bytes=4 * MiB)
    assert b2.stats().tier("disk").entries == len(pages)
    assert await b2.lookup(fp, [h for h, _, _ in pages]) == len(pages)
    for h, data, _ in pages:
        assert await b2.get(fp, h) == data
    # A smaller budget at restart evicts down to it, least recently used first.
    await b2.close()
    b3 = EmbeddedBackend(memory_bytes=0, disk_dir=tmp_path, disk_bytes=3 * (20 * KiB + HEADER_SIZE))
    assert b3.stats().tier("disk").entries == 3
    _assert_within_budget(b3)


def _page_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.page"))


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "bad_magic", "append"])
async def test_damaged_file_detected_on_read(tmp_path: Path, page: PageFactory, damage: str) -> None:
    b = EmbeddedBackend(memory_bytes=0, disk_dir=tmp_path, disk_bytes=1 * MiB)
    fp = new_fp()
    h, data, crc = page(10 * KiB)
    await b.put(fp, h, data, crc)
    (path,) = _page_files(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        raw[HEADER_SIZE + 1234] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) - 100]
    elif damage == "bad_magic":
        raw[0] ^= 0xFF
    else:
        raw += b"trailing garbage"
    path.write_bytes(bytes(raw))
    assert await b.get(fp, h) is None  # never served
    stats = b.stats().tier("disk")
    assert stats.corrupt == 1 and stats.misses == 1 and stats.entries == 0 and stats.bytes == 0
    assert not path.exists()  # removed
    assert await b.lookup(fp, [h]) == 0
    assert await b.put(fp, h, data, crc)  # and can be stored again
    assert await b.get(fp, h) == data


async def test_damaged_files_dropped_at_restart(tmp_path: Path, page: PageFactory) -> None:
    fp = new_fp()
    b = EmbeddedBackend(memory_bytes=0, disk_dir=tmp_path, disk_bytes=1 * MiB)
    pages = [page(4 * KiB) for _ in range(4)]
    for p in pages:
        await b.put(fp, *p)
    files = {p.name: p for p in _page_files(tmp_path)}
    truncated = files[pages[0][0].hex() + ".page"]
    truncated.write_bytes(truncated.read_bytes()[:HEADER_SIZE + 10])
    flipped = files[pages[1][0].hex() + ".page"]
    raw = bytearray(flipped.read_bytes())
    raw[-1] ^= 1
    flipped.write_bytes(bytes(raw))
    misplaced = tmp_path / fp / "zz" / "not-a-hash.page"
    misplaced.parent.mkdir()
    misplaced.write_bytes(b"junk")
    torn = tmp_path / fp / "00" / "whatever.page.1.2.tmp"
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"partial")

    b2 = EmbeddedBackend(memory_bytes=0, disk_dir=tmp_path, disk_bytes=1 * MiB)
    stats = b2.stats().tier("disk")
    assert stats.corrupt == 2  # truncated + misplaced (header-only scan: the CRC flip shows on read)
    assert stats.entries == 3
    assert not truncated.exists() and not misplaced.exists() and not torn.exists()
    assert await b2.get(fp, pages[0][0]) is None
    assert await b2.get(fp, pages[1][0]) is None  # CRC failure
    assert b2.stats().tier("disk").corrupt == 3
    for h, data, _ in pages[2:]:
        assert await b2.get(fp, h) == data


async def test_file_deleted_underneath_is_a_plain_miss(tmp_path: Path, page: PageFactory) -> None:
    b = EmbeddedBackend(memory_bytes=0, disk_dir=tmp_path, disk_bytes=1 * MiB)
    fp = new_fp()
    h, data, crc = page(1 * KiB)
    await b.put(fp, h, data, crc)
    (path,) = _page_files(tmp_path)
    path.unlink()
    assert await b.get(fp, h) is None
    stats = b.stats().tier("disk")
    assert stats.corrupt == 0 and stats.entries == 0


def test_disk_tier_layout(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 * MiB)
    fp, h = "0123456789abcdef", bytes(range(16))
    data = os.urandom(100)
    assert tier.put((fp, h), data, checksum(data))
    assert tier.path((fp, h)) == tmp_path / fp / "00" / f"{h.hex()}.page"
    assert tier.path((fp, h)).stat().st_size == HEADER_SIZE + 100
    assert tier.get((fp, h)) == (data, checksum(data))
