"""KVChunk on the wire with its page bytes left where they lie: written from a memoryview by prefill
(``serialize``), read as a memoryview by decode (``parse_chunk``).

Protobuf allows fields in any order and, for a repeated scalar field such as ``payload``, the last
occurrence wins. So a KVChunk is its header (every field but ``payload``, parsed by protobuf) plus the
payload field, written or found by hand:

  * prefill: header bytes, then tag 10 / length / payload copied once from the page tensor's memoryview;
  * decode: the top-level fields are walked (tags and lengths only, no copy of the payload); every
    payload field is cut out, the rest (a few hundred bytes) is parsed by protobuf, and the payload is a
    memoryview into the received message bytes (the last occurrence, as protobuf would keep). The pages
    are then copied once from that view into the KV pool.

A message that is not valid protobuf wire format (a truncated varint or length, a field running past
the end, a group or reserved wire type, field number 0) parses to a WireChunk whose ``error`` says why,
never an exception: the receiver answers it with INVALID_ARGUMENT like any other bad chunk.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from services.common.pb import common_pb2

PAYLOAD_FIELD = 10
PAYLOAD_TAG = bytes([(PAYLOAD_FIELD << 3) | 2])
"""KVChunk.payload: field 10, wire type 2 (length-delimited)."""
_MAX_VARINT_BYTES = 10
MAX_FIELDS = 1024
"""Most top-level fields a PushKV message may have (a KVChunk has 21, each written once): the walk runs
on decode's event loop, so a message of millions of tiny fields is refused instead of walked."""


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def serialize(msg: common_pb2.KVChunk | tuple[common_pb2.KVChunk, memoryview | bytes] | bytes) -> bytes:
    """A KVChunk, or (header, payload): the header's bytes then the payload field, in one copy (bytes.join
    drops the GIL while it copies a large payload, so a worker thread may run it); bytes: already
    serialized, passed through."""
    if isinstance(msg, bytes):
        return msg
    if isinstance(msg, common_pb2.KVChunk):
        return msg.SerializeToString()
    header, payload = msg
    if not len(payload):
        return header.SerializeToString()
    return b"".join((header.SerializeToString(), PAYLOAD_TAG, varint(len(payload)), payload))


PADDING_FIELD = 22
PADDING_TAG = varint((PADDING_FIELD << 3) | 2)
"""KVChunk.padding: field 22, wire type 2 (two bytes)."""

if sys.implementation.name == "cpython":
    # The C API's way to build a bytes object in place: allocate it uninitialized, fill it, then share it.
    _new_bytes = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_char_p, ctypes.c_ssize_t)(
        ("PyBytes_FromStringAndSize", ctypes.pythonapi))
    _bytes_address = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object)(("PyBytes_AsString", ctypes.pythonapi))
else:  # pragma: no cover - other interpreters keep the joined copy (serialize)
    _new_bytes = _bytes_address = None

IN_PLACE = _new_bytes is not None
"""Messages can be built around their pages (MessageBuffer): CPython only."""


def padding(room: int) -> bytes | None:
    """KVChunk.padding fields of exactly ``room`` bytes (b"" for 0); None for 1 or 2 bytes (no field is that
    short). One field, or, where no length fits exactly (e.g. 131), an empty field and then one that does."""
    out = b""
    while room:
        for vlen in (1, 2, 3):
            n = room - len(PADDING_TAG) - vlen
            if n >= 0 and len(varint(n)) == vlen:
                return out + PADDING_TAG + varint(n) + bytes(n)
        if room < len(PADDING_TAG) + 1:
            return None
        out += PADDING_TAG + b"\x00"
        room -= len(PADDING_TAG) + 1
    return out


class MessageBuffer:
    """One PushKV message's bytes, made before its header is known so that the pages are gathered straight
    into them: ``room`` bytes for the header, then ``payload_nbytes`` of payload. The export fills the payload
    (``writable``, from ``room`` on); ``seal`` then writes the header, KVChunk.padding over what it leaves
    of the room, and the payload field's tag and length, and hands the bytes over. Nothing else holds the
    bytes object until then (CPython's contract for a bytes built in place)."""

    def __init__(self, payload_nbytes: int, room: int) -> None:
        assert IN_PLACE, "MessageBuffer needs CPython"
        if room + payload_nbytes < 2:  # CPython shares its 0- and 1-byte bytes objects: never write into those
            raise ValueError(f"a message of {room + payload_nbytes} bytes is too short to build in place")
        self.room = room
        self.payload_nbytes = payload_nbytes
        self._data: bytes | None = _new_bytes(None, room + payload_nbytes)
        self.writable = (ctypes.c_char * (room + payload_nbytes)).from_address(_bytes_address(self._data))
        """The message's memory, writable (a ctypes array; use while ``_data`` is alive and unsealed)."""

    @property
    def payload(self) -> memoryview:
        """The payload region, read-only (the view keeps the bytes alive)."""
        assert self._data is not None, "sealed"
        return memoryview(self._data)[self.room:]

    def seal(self, header: common_pb2.KVChunk) -> bytes | None:
        """The whole message (header, padding, payload), or None when the header does not fit the room:
        then the caller sends ``payload`` the usual way (serialize: one more copy)."""
        assert self._data is not None, "sealed twice"
        head = header.SerializeToString()
        tail = PAYLOAD_TAG + varint(self.payload_nbytes)
        pad = padding(self.room - len(head) - len(tail)) if len(head) + len(tail) <= self.room else None
        if pad is None:
            return None
        memoryview(self.writable).cast("B")[:self.room] = head + pad + tail
        data, self._data = self._data, None
        return data


@dataclass(frozen=True)
class WireChunk:
    """A PushKV message as decode's request deserializer leaves it."""

    header: common_pb2.KVChunk
    """Every field but payload (empty when ``error`` is set)."""
    payload: memoryview
    """The payload bytes: a read-only view into the received message (no copy)."""
    error: str = ""
    """Why the message is not a valid KVChunk; empty when it is."""

    @property
    def transport(self) -> str:
        return self.header.transport


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, position after it); ValueError when the varint is truncated or longer than 10 bytes."""
    value = shift = 0
    end = min(len(data), pos + _MAX_VARINT_BYTES)
    while pos < end:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError(f"truncated or overlong varint at byte {pos}")


def _payload_spans(data: bytes) -> list[tuple[int, int, int]]:
    """(field start, value start, value end) of every top-level payload field; ValueError when ``data``
    is not protobuf wire format (fields are walked by tag and length only)."""
    spans: list[tuple[int, int, int]] = []
    pos, n, fields = 0, len(data), 0
    while pos < n:
        fields += 1
        if fields > MAX_FIELDS:
            raise ValueError(f"more than {MAX_FIELDS} top-level fields")
        start = pos
        tag, pos = _read_varint(data, pos)
        field, wire_type = tag >> 3, tag & 7
        if field == 0:
            raise ValueError(f"field number 0 at byte {start}")
        if wire_type == 0:
            _, pos = _read_varint(data, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(data, pos)
            if field == PAYLOAD_FIELD:
                spans.append((start, pos, pos + length))
            pos += length
        else:
            raise ValueError(f"field {field}: wire type {wire_type} (groups/reserved) at byte {start}")
        if pos > n:
            raise ValueError(f"field {field} at byte {start} runs past the end of the {n}-byte message")
    return spans


def parse_chunk(data: bytes) -> WireChunk:
    """PushKV's request deserializer on decode: the header parsed, the payload a view (see module doc)."""
    view = memoryview(data)
    try:
        spans = _payload_spans(data)
    except ValueError as e:
        return WireChunk(common_pb2.KVChunk(), view[:0], f"not a KVChunk message ({len(data)} bytes): {e}")
    if not spans:
        header_bytes = data
        payload = view[:0]
    else:
        kept, prev = [], 0
        for start, _, end in spans:
            kept.append(view[prev:start])
            prev = end
        kept.append(view[prev:])
        header_bytes = b"".join(kept)
        payload = view[spans[-1][1]:spans[-1][2]]
    try:
        header = common_pb2.KVChunk.FromString(header_bytes)
    except DecodeError as e:
        return WireChunk(common_pb2.KVChunk(), view[:0], f"not a KVChunk message ({len(data)} bytes): {e}")
    return WireChunk(header, payload)
