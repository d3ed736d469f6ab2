"""Splitting pages into ``Page`` message pieces and reassembling them (both sides of Get and Put).

A page larger than one gRPC message travels as pieces sent back to back: same fingerprint, hash,
checksum and total_size on each, increasing contiguous offsets, ``last_piece`` on the final one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from services.common.grpc_util import MiB
from services.common.pb import kvstore_pb2 as pb


def key_str(fp: str, h: bytes) -> str:
    """The printable page key ``<fp>/<hash hex>`` (as the kvstore prints it)."""
    return f"{fp}/{h.hex()}"


DEFAULT_PIECE_BYTES = 4 * MiB
"""Payload bytes per Page message (well under the 64 MiB message limit)."""


def split_page(fp: str, h: bytes, data: bytes, crc: int, piece_bytes: int = DEFAULT_PIECE_BYTES
               ) -> Iterator[pb.Page]:
    """The Page messages carrying ``data`` (one for an empty or small page)."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    total = len(data)
    view = memoryview(data)
    offset = 0
    while True:
        end = min(offset + piece_bytes, total)
        yield pb.Page(layout_fingerprint=fp, block_hash=h, payload=bytes(view[offset:end]) if (offset, end) != (0, total)
                      else data, checksum=crc, offset=offset, total_size=total, last_piece=end == total)
        offset = end
        if offset >= total:
            return


PAYLOAD_TAG = bytes([(3 << 3) | 2])
"""Page.payload: field 3, wire type 2 (length-delimited)."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def serialized_pieces(fp: str, h: bytes, data: bytes | memoryview, crc: int, piece_bytes: int = DEFAULT_PIECE_BYTES
                      ) -> Iterator[bytes]:
    """``split_page``'s messages already serialized, each payload copied once from ``data`` (any buffer, e.g. a
    row of pinned host pages): the other fields, then the payload field (protobuf takes fields in any order).
    ``bytes.join`` copies a large payload without holding the GIL, so a worker thread builds them while the
    process's event loop and engine thread run."""
    if piece_bytes <= 0:
        raise ValueError(f"piece_bytes must be > 0, got {piece_bytes}")
    view = memoryview(data).cast("B")
    total = len(view)
    offset = 0
    while True:
        end = min(offset + piece_bytes, total)
        head = pb.Page(layout_fingerprint=fp, block_hash=h, checksum=crc, offset=offset, total_size=total,
                       last_piece=end == total).SerializeToString()
        yield b"".join((head, PAYLOAD_TAG, _varint(end - offset), view[offset:end])) if end > offset else head
        offset = end
        if offset >= total:
            return


class PageStreamError(ValueError):
    """A piece stream is malformed; ``kind`` picks the gRPC status (see servicer)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "invalid" | "too_large"


@dataclass
class AssembledPage:
    fp: str
    h: bytes
    data: bytes
    crc: int


class PageAssembler:
    """Feeds pieces in order; ``add`` returns a whole page on its last piece, else None.

    Memory grows only with the bytes that arrived: a piece's ``total_size`` is an announcement, checked
    against ``max_page_bytes`` at once but never allocated ahead (the pieces are joined on the last one).
    """

    def __init__(self, max_page_bytes: int) -> None:
        self.max_page_bytes = max_page_bytes
        self._head: pb.Page | None = None
        self._pieces: list[bytes] = []
        self._filled = 0

    @property
    def in_progress(self) -> str | None:
        """Key of a page whose last piece has not arrived, or None."""
        return key_str(self._head.layout_fingerprint, self._head.block_hash) if self._head is not None else None

    def add(self, piece: pb.Page) -> AssembledPage | None:
        size = len(piece.payload)
        if self._head is None:
            if piece.total_size > self.max_page_bytes:
                raise PageStreamError("too_large", f"page {key_str(piece.layout_fingerprint, piece.block_hash)}: "
                                      f"total_size {piece.total_size} bytes exceeds the {self.max_page_bytes}-byte "
                                      f"page limit (--max-page-bytes)")
            if piece.offset != 0:
                raise PageStreamError("invalid", f"page {key_str(piece.layout_fingerprint, piece.block_hash)}: "
                                      f"first piece has offset {piece.offset}, expected 0")
            if piece.last_piece and size == piece.total_size:
                return AssembledPage(piece.layout_fingerprint, piece.block_hash, piece.payload, piece.checksum)
            self._head = piece
            self._pieces = []
            self._filled = 0
        head = self._head
        name = key_str(head.layout_fingerprint, head.block_hash)
        if (piece.layout_fingerprint, piece.block_hash, piece.checksum, piece.total_size) != (
                head.layout_fingerprint, head.block_hash, head.checksum, head.total_size):
            raise PageStreamError("invalid", f"page {name}: piece at offset {piece.offset} names another page "
                                  f"({key_str(piece.layout_fingerprint, piece.block_hash)}, total_size "
                                  f"{piece.total_size}, checksum {piece.checksum}) before the last piece")
        if piece.offset != self._filled:
            raise PageStreamError("invalid", f"page {name}: piece offset {piece.offset}, expected {self._filled} "
                                  "(pieces must be contiguous and in order)")
        if self._filled + size > head.total_size:
            raise PageStreamError("invalid", f"page {name}: pieces add up to more than total_size "
                                  f"{head.total_size} bytes")
        if size:
            self._pieces.append(piece.payload)
        self._filled += size
        if not piece.last_piece:
            return None
        if self._filled != head.total_size:
            raise PageStreamError("invalid", f"page {name}: truncated: pieces add up to {self._filled} of "
                                  f"total_size {head.total_size} bytes")
        page = AssembledPage(head.layout_fingerprint, head.block_hash, b"".join(self._pieces), head.checksum)
        self._head, self._pieces, self._filled = None, [], 0
        return page

    def finish(self) -> None:
        """End of stream: raise if a page is incomplete."""
        if self._head is not None:
            raise PageStreamError("invalid", f"page {self.in_progress}: truncated: stream ended after "
                                  f"{self._filled} of total_size {self._head.total_size} bytes (no last_piece)")
