"""The grpc transport's hand-serialized messages and the Mooncake descriptor checks, without servers."""

from __future__ import annotations

import os

import pytest

from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2
from services.engine.kv_transport.grpc_wire import serialize
from services.engine.kv_transport.grpc_wire import varint as _varint
from services.engine.kv_transport.mooncake import check_pool
from services.engine.shared_kv import SharedKVAttachError

SHAPE = [2, 2, 8, 4, 2, 8]
POOL_BYTES = 4 * 2 * 2 * 8 * 4 * 2 * 8


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 16383, 16384, 1 << 21, (1 << 24) + 5])
def test_header_plus_hand_written_payload_parses_as_the_full_message(size: int) -> None:
    header = common_pb2.KVChunk(request_id="r", reservation_id="rsv", chunk_index=7, first_block=3, num_pages=2,
                                checksum=0xDEADBEEF, reservation_token=bytes(range(16)), transport="grpc",
                                codec=common_pb2.KV_CODEC_NATIVE, is_last=True, first_token=42)
    payload = os.urandom(size)
    wire = serialize((header, memoryview(payload)))
    got = common_pb2.KVChunk.FromString(wire)
    want = common_pb2.KVChunk()
    want.CopyFrom(header)
    want.payload = payload
    assert got == want
    assert len(wire) == want.ByteSize()  # not a byte more than protobuf's own encoding


def test_varint_matches_protobuf() -> None:
    assert _varint(0) == b"\x00"
    for n in (1, 127, 128, 255, 300, 1 << 28, (1 << 32) - 1):
        assert common_pb2.KVChunk(token_end=n).SerializeToString() == b"\x28" + _varint(n)  # field 5, varint


def _mooncake(**kw: object) -> decode_pb2.MooncakePool:
    fields: dict = dict(segment="10.0.0.7:15001", base_address=0x7F0000000000, pool_bytes=POOL_BYTES, shape=SHAPE,
                        dtype="float32", protocol="tcp")
    fields.update(kw)
    return decode_pb2.MooncakePool(**fields)


def test_a_mooncake_pool_on_the_decode_the_stream_goes_to_is_accepted() -> None:
    shape, _ = check_pool(_mooncake(), "10.0.0.7:50062")
    assert list(shape) == SHAPE
    dest = decode_pb2.KVDestination(mooncake=_mooncake())
    assert pool_id(dest) == "mooncake:10.0.0.7:15001@7f0000000000"


@pytest.mark.parametrize(("overrides", "address", "reason"), [
    ({}, "10.0.0.8:50062", "host"),                          # a segment on another host than the decode
    ({"segment": "10.0.0.7"}, "10.0.0.7:50062", "segment"),  # no port
    ({"segment": "10.0.0.7:0"}, "10.0.0.7:50062", "segment"),
    ({"segment": "10.0.0.7:abc"}, "10.0.0.7:50062", "segment"),
    ({"pool_bytes": POOL_BYTES * 2}, "10.0.0.7:50062", "shape"),
    ({"base_address": 0}, "10.0.0.7:50062", "shape"),
    ({"shape": [2, 2, 8]}, "10.0.0.7:50062", "shape"),
    ({"dtype": "int8"}, "10.0.0.7:50062", "dtype"),
])
def test_mooncake_descriptors_that_fail_a_check_are_refused(overrides: dict, address: str, reason: str) -> None:
    with pytest.raises(SharedKVAttachError) as e:
        check_pool(_mooncake(**overrides), address)
    assert e.value.reason == reason


def test_padding_fills_every_room_but_one_or_two_bytes_and_parses_as_padding_only() -> None:
    from services.engine.kv_transport.grpc_wire import padding

    for room in range(0, 20000):
        pad = padding(room)
        if room in (1, 2):
            assert pad is None
            continue
        assert pad is not None and len(pad) == room, room
        parsed = common_pb2.KVChunk.FromString(pad)
        assert not any(parsed.padding) and parsed.ByteSize() <= room
        parsed.ClearField("padding")
        assert parsed == common_pb2.KVChunk()


def test_a_header_too_large_for_its_room_leaves_the_message_unsealed_for_the_copying_path() -> None:
    from services.engine.kv_transport.grpc_wire import MessageBuffer, parse_chunk

    buf = MessageBuffer(1000, 64)
    memoryview(buf.writable).cast("B")[64:] = bytes(range(200)) * 5
    big = common_pb2.KVChunk(request_id="x" * 100, num_pages=1)
    assert buf.seal(big) is None
    assert bytes(buf.payload) == bytes(range(200)) * 5  # still whole: sent through serialize instead
    wire = serialize((big, buf.payload))
    assert bytes(parse_chunk(wire).payload) == bytes(range(200)) * 5
    small = common_pb2.KVChunk(request_id="x", num_pages=1)
    sealed = buf.seal(small)
    assert sealed is not None and bytes(parse_chunk(sealed).payload) == bytes(range(200)) * 5


@pytest.mark.parametrize("top_k", [0, 1, 20])
def test_header_room_holds_the_largest_header_of_the_request(top_k: int) -> None:
    """Every number at its longest encoding, the last message's alternatives: the header still fits, so no
    message of the request falls back to the copying path."""
    from services.engine.kv_layout import PageLayout
    from services.engine.kv_transport.grpc_wire import MessageBuffer, parse_chunk
    from services.prefill.kv_stream import header_room

    layout = PageLayout.for_model("some/model", 30, 3, 64, 16, "bf16")
    room = header_room("r" * 70, "rsv-" + "9" * 32, bytes(32), layout, "grpc", top_k)
    assert room % 64 == 0
    for payload_nbytes in (1, 127, 128, 1 << 21, (8 << 20) + 7):
        header = common_pb2.KVChunk(
            request_id="r" * 70, reservation_id="rsv-" + "9" * 32, chunk_index=0xFFFFFFFF, token_start=0xFFFFFFFF,
            token_end=0xFFFFFFFF, first_block=0xFFFFFFFF, num_pages=0xFFFFFFFF, layout_fingerprint=layout.fingerprint,
            checksum=0xFFFFFFFF, transport="grpc", is_last=True, first_token=-(1 << 31), first_logprob=-1e30,
            prefill_done_unix=1.7e9, total_chunks=0xFFFFFFFF, reservation_token=bytes(32),
            codec=common_pb2.KV_CODEC_FP8_E4M3,
            first_top_logprobs=common_pb2.TopLogprobs(token_ids=[-(1 << 31)] * top_k, logprobs=[-1e30] * top_k))
        wire = MessageBuffer(payload_nbytes, room).seal(header)
        assert wire is not None and len(wire) == room + payload_nbytes
        assert parse_chunk(wire).header.first_top_logprobs == header.first_top_logprobs


def test_a_message_too_short_to_be_its_own_object_is_never_built_in_place() -> None:
    from services.engine.kv_transport.grpc_wire import MessageBuffer

    for room, size in ((0, 0), (0, 1), (1, 0)):
        with pytest.raises(ValueError, match="too short"):
            MessageBuffer(size, room)
    assert b"" == bytes(0) and bytes(1) == b"\x00"  # the shared objects are untouched
