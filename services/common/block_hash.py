"""Chained content hashes of full KV blocks, identical in every process.

Router, prefill, decode and kvstore all key KV pages by these hashes, so they must never depend on
Python's per-process ``hash()`` randomisation. A block's hash covers its parent's hash and its own
tokens, so equal hashes mean equal whole prefixes, not only equal blocks.

    hash(block_i) = blake2b_16(hash(block_{i-1}) || int32_le(tokens of block_i))
    hash(block_{-1}) = 16 zero bytes
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Iterator, Sequence

HASH_SIZE = 16
"""Bytes per block hash."""

ROOT_HASH = bytes(HASH_SIZE)
"""Parent of the first block of every sequence."""

_INT32 = "i" if array("i").itemsize == 4 else "l"
assert array(_INT32).itemsize == 4, "no 4-byte signed integer array type on this platform"
_BIG_ENDIAN = sys.byteorder == "big"


def _tokens_le_int32(token_ids: Sequence[int]) -> bytes:
    """Tokens as little-endian int32 bytes. Raises OverflowError for ids outside int32."""
    arr = array(_INT32, token_ids)
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.blake2b(parent if parent is not None else ROOT_HASH, digest_size=HASH_SIZE)
    h.update(_tokens_le_int32(token_ids))
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """Chained hashes of the FULL blocks of ``token_ids``; a trailing partial block is not hashed.

    ``parent`` is the hash of the block before ``token_ids[0]`` (None when it starts a sequence).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    buf = memoryview(_tokens_le_int32(token_ids[: num_full * block_size]))
    stride = block_size * 4
    out: list[bytes] = []
    prev = parent if parent is not None else ROOT_HASH
    for i in range(num_full):
        h = hashlib.blake2b(prev, digest_size=HASH_SIZE)
        h.update(buf[i * stride : (i + 1) * stride])
        prev = h.digest()
        out.append(prev)
    return out


LAZY_WINDOW_BLOCKS = 32
"""Blocks whose tokens ``iter_block_hashes`` converts to bytes at a time (one C call per window)."""


def iter_block_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None, *,
                      max_tokens: int | None = None) -> Iterator[bytes]:
    """The hashes of ``block_hashes``, one at a time: a consumer that stops early (a prefix-cache lookup
    ends at its first miss) converts and hashes only the blocks it took, plus the rest of one window.
    ``max_tokens`` (>= 0; below counts as 0): only the full blocks of ``token_ids[:max_tokens]``, without copying."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    num_full = (len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))) // block_size
    stride = block_size * 4
    prev = parent if parent is not None else ROOT_HASH
    for w in range(0, num_full, LAZY_WINDOW_BLOCKS):
        n = min(LAZY_WINDOW_BLOCKS, num_full - w)
        buf = memoryview(_tokens_le_int32(token_ids[w * block_size : (w + n) * block_size]))
        for i in range(n):
            h = hashlib.blake2b(prev, digest_size=HASH_SIZE)
            h.update(buf[i * stride : (i + 1) * stride])
            prev = h.digest()
            yield prev


def hash_to_hex(block_hash: bytes) -> str:
    return block_hash.hex()


def hash_from_hex(text: str) -> bytes:
    """Inverse of ``hash_to_hex``; raises ValueError on malformed input."""
    raw = bytes.fromhex(text)
    if len(raw) != HASH_SIZE:
        raise ValueError(f"block hash must be {HASH_SIZE} bytes ({2 * HASH_SIZE} hex digits), got {len(raw)}")
    return raw
