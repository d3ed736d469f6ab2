"""Payload checksums (torch-free, so the kvstore can import it cheaply)."""

from __future__ import annotations

import zlib


def checksum(data: bytes | memoryview) -> int:
    """CRC-32 of a payload (zlib's; runs at GB/s and ships with Python)."""
    return zlib.crc32(data) & 0xFFFFFFFF
