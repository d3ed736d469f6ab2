"""The grpc transport's hand-serialized messages and the Mooncake descriptor checks, without servers."""

from __future__ import annotations

import os

import pytest

from services.common.pb import common_pb2, decode_pb2
from services.engine.kv_transport.grpc_wire import serialize
from services.engine.kv_transport.grpc_wire import varint as _varint
from services.engine.kv_transport.mooncake import check_pool
from services.engine.shared_kv import SharedKVAttachError, pool_id

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
