"""One page-record format: the disk tier's file and the Mooncake backend's value are the same bytes,
and every way a record can be wrong is caught before a byte is served."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.checksum import checksum
from services.kvstore.backend import KVStoreBackend, key_str
from services.kvstore.disk_tier import DiskTier
from services.kvstore.page_record import (
    HEADER_SIZE,
    MAGIC,
    RecordHeader,
    decode_header,
    encode_header,
    parse_record,
)
from tests.kvstore.conftest import KiB, PageFactory, mooncake_skip_reason, new_fp


def _record(fp: str, h: bytes, data: bytes) -> bytes:
    return encode_header(fp, h, len(data), checksum(data)) + data


def test_header_round_trip(page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(1 * KiB)
    raw = encode_header(fp, h, len(data), crc)
    assert len(raw) == HEADER_SIZE and raw.startswith(MAGIC)
    assert decode_header(raw) == RecordHeader(fp, h, len(data), crc)
    assert parse_record(raw + data, (fp, h)) == ((data, crc), None)


def test_every_broken_record_is_refused(page: PageFactory) -> None:
    fp = new_fp()
    (h, data, _), (other, _, _) = page(1 * KiB), page(1 * KiB)
    good = _record(fp, h, data)
    flipped = bytearray(good)
    flipped[HEADER_SIZE + 5] ^= 1
    cases = {
        "truncated header": good[:HEADER_SIZE - 1],
        "truncated payload": good[:-1],
        "padded": good + b"\0",
        "another key": _record(fp, other, data),
        "payload bit flip": bytes(flipped),
        "foreign bytes": b"not a pdserve page" * 8,
        "other version": good[:8] + (99).to_bytes(2, "little") + good[10:],
    }
    for name, value in cases.items():
        got, problem = parse_record(value, (fp, h))
        assert got is None and problem, name


async def test_disk_file_is_the_record(tmp_path: Path, page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(3 * KiB)
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.put((fp, h), data, crc)
    assert tier.path((fp, h)).read_bytes() == _record(fp, h, data)


@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason()))
async def test_mooncake_value_is_the_same_record(shared_mooncake: KVStoreBackend, tmp_path: Path,
                                                 page: PageFactory) -> None:
    fp = new_fp()
    h, data, crc = page(3 * KiB)
    assert await shared_mooncake.put(fp, h, data, crc)
    value = shared_mooncake._store.get(key_str(fp, h))  # type: ignore[attr-defined]
    tier = DiskTier(tmp_path, 1 << 20)
    assert tier.put((fp, h), data, crc)
    assert value == tier.path((fp, h)).read_bytes()
