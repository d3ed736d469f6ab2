"""The one stored form of a KV page, shared by every kvstore tier and backend that keeps bytes
(the disk tier's files, the Mooncake backend's values): a fixed header, then the payload.

    magic "PDKVPAGE" 8s | version u16 | header size u16 | fingerprint 16s | block hash 16s |
    payload length u64 | crc32 u32 | reserved u32             (little-endian, HEADER_SIZE bytes)

A record names its own key, length and CRC-32, so one found under another key, truncated, padded
or failing its CRC is detected (:func:`record_problem`) and never served. The memory tier keeps
(payload, crc) objects and has no stored form.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from services.common.checksum import checksum
from services.kvstore.backend import Key, key_str

MAGIC = b"PDKVPAGE"
VERSION = 1
_HEADER = struct.Struct("<8sHH16s16sQI4x")
HEADER_SIZE = _HEADER.size
"""Bytes in front of every stored payload."""

class RecordHeader(NamedTuple):
    fp: str
    h: bytes
    length: int
    """Payload bytes after the header."""
    crc: int
    """CRC-32 of the payload (services.common.checksum)."""


def encode_header(fp: str, h: bytes, length: int, crc: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, HEADER_SIZE, fp.encode("ascii"), h, length, crc)


def decode_header(raw: bytes | memoryview) -> RecordHeader | None:
    """The header at the start of ``raw``, or None when ``raw`` does not start with a valid one."""
    if len(raw) < HEADER_SIZE:
        return None
    magic, version, hsize, fp, h, length, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION or hsize != HEADER_SIZE:
        return None
    try:
        fp_str = fp.decode("ascii")
    except UnicodeDecodeError:
        return None
    return RecordHeader(fp_str, h, length, crc)


def record_problem(header: RecordHeader | None, key: Key, record_bytes: int) -> str | None:
    """Why a record of ``record_bytes`` bytes (header included) with ``header`` is not the record of
    ``key``, or None. The payload's CRC is checked apart (:func:`crc_problem`): a reader may stop here."""
    if header is None:
        return "bad header"
    if (header.fp, header.h) != key:
        return f"header names {key_str(header.fp, header.h)}"
    if record_bytes != HEADER_SIZE + header.length:
        return f"record is {record_bytes} bytes, header says {HEADER_SIZE + header.length}"
    return None


def crc_problem(payload: bytes | memoryview, crc: int) -> str | None:
    got = checksum(payload)
    return None if got == crc else f"crc32 0x{got:08x} != stored 0x{crc:08x}"


def parse_record(value: bytes, key: Key) -> tuple[tuple[bytes, int] | None, str | None]:
    """A whole record held in memory -> ((payload, crc), None), or (None, why it is not valid)."""
    header = decode_header(value)
    problem = record_problem(header, key, len(value))
    if problem is None:
        assert header is not None
        problem = crc_problem(memoryview(value)[HEADER_SIZE:], header.crc)
    if problem is not None or header is None:
        return None, problem
    return (value[HEADER_SIZE:], header.crc), None
