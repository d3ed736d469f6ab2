"""PushKV parsed header-only (grpc_wire.parse_chunk): the same message protobuf would parse, the payload
a view into the received bytes, malformed frames refused with a clear status on a real decode."""

from __future__ import annotations

import os
import random

import grpc
import pytest
from google.protobuf.message import DecodeError

from services.common.grpc_util import Reason
from services.common.pb import common_pb2
from services.engine.kv_transport.grpc_wire import PAYLOAD_TAG, parse_chunk, serialize, varint
from tests.decode.kv_util import PROMPT, chunks, idle, refused, reserved, run_to_end

REJECTED = "pdserve_decode_kv_chunks_rejected_total"
HEADER = common_pb2.KVChunk(request_id="r", reservation_id="rsv", chunk_index=7, first_block=3, num_pages=2,
                            checksum=0xDEADBEEF, reservation_token=bytes(range(16)), transport="grpc",
                            codec=common_pb2.KV_CODEC_NATIVE, is_last=True, first_token=42,
                            first_top_logprobs=common_pb2.TopLogprobs(token_ids=[1, 2], logprobs=[-0.5, -1.5]))


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16384, 1 << 21])
def test_header_and_payload_view_equal_protobufs_parse(size: int) -> None:
    payload = os.urandom(size)
    wire = serialize((HEADER, memoryview(payload)))
    got = parse_chunk(wire)
    full = common_pb2.KVChunk.FromString(wire)
    assert not got.error
    assert bytes(got.payload) == full.payload == payload
    full.ClearField("payload")
    assert got.header == full
    assert got.transport == "grpc"
    if size:
        assert got.payload.obj is wire  # a view into gRPC's bytes, not a copy


def test_payload_anywhere_and_repeated_keeps_the_last_like_protobuf() -> None:
    head = common_pb2.KVChunk(request_id="r").SerializeToString()
    rest = common_pb2.KVChunk()
    rest.CopyFrom(HEADER)
    rest.ClearField("request_id")
    first, last = os.urandom(300), os.urandom(500)
    field = lambda p: PAYLOAD_TAG + varint(len(p)) + p  # noqa: E731
    wire = head + field(first) + rest.SerializeToString() + field(last) + common_pb2.KVChunk(num_pages=9).SerializeToString()
    got = parse_chunk(wire)
    full = common_pb2.KVChunk.FromString(wire)
    assert not got.error and bytes(got.payload) == full.payload == last
    full.ClearField("payload")
    assert got.header == full and got.header.num_pages == 9 and got.header.request_id == "r"


@pytest.mark.parametrize("wire,why", [
    (PAYLOAD_TAG + varint(100) + b"short", "runs past the end"),  # a length longer than the frame
    (PAYLOAD_TAG + b"\xff\xff", "varint"),  # a truncated length
    (b"\x80" * 11, "varint"),  # an overlong tag
    (bytes([(3 << 3) | 3]), "wire type 3"),  # a group
    (bytes([(3 << 3) | 7, 0]), "wire type 7"),
    (b"\x00\x01", "field number 0"),
    (bytes([(9 << 3) | 5, 1, 2]), "runs past the end"),  # a fixed32 cut short
    (bytes([(1 << 3) | 2, 2, 0xff, 0xfe]), "not a KVChunk"),  # request_id: not UTF-8 (protobuf refuses)
    (bytes([(3 << 3), 1]) * 1025, "more than 1024 top-level fields"),  # chunk_index over and over
])
def test_malformed_frames_give_an_error_never_an_exception(wire: bytes, why: str) -> None:
    got = parse_chunk(wire)
    assert why in got.error and "not a KVChunk message" in got.error
    assert len(got.payload) == 0 and got.header == common_pb2.KVChunk()


def test_mutated_messages_parse_exactly_when_protobuf_does() -> None:
    rng = random.Random(7)
    base = serialize((HEADER, memoryview(os.urandom(64))))
    for _ in range(3000):
        wire = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            wire[rng.randrange(len(wire))] = rng.randrange(256)
        wire = bytes(wire[:rng.randint(0, len(wire))]) if rng.random() < 0.3 else bytes(wire)
        got = parse_chunk(wire)
        try:
            full = common_pb2.KVChunk.FromString(wire)
        except DecodeError:
            assert got.error, wire
            continue
        assert not got.error, (wire, got.error)
        assert bytes(got.payload) == full.payload
        full.ClearField("payload")
        assert got.header == full


async def test_a_malformed_message_mid_stream_is_invalid_argument_and_frees_the_reservation(decode_rig):
    rig = await decode_rig()
    base, ref, resv = await reserved(rig)
    good = chunks(resv, PROMPT, ref)
    method = rig.channel.stream_unary("/pdserve.v1.Decode/PushKV", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)

    async def gen():
        yield good[0].SerializeToString()
        yield good[1].SerializeToString()[:-3]  # cut short inside its payload

    out = await refused(method(gen(), timeout=30))
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT, out
    assert "PushKV message: not a KVChunk message" in out.details and "runs past the end" in out.details
    assert out.detail.reason == Reason.ERROR_REASON_INVALID_INPUT and out.detail.side == "decode"
    assert rig.servicer.table.get(resv.reservation_id) is None  # a protocol violation frees it
    assert rig.metric(REJECTED, reason="malformed") == 1
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_header_only_parsed_stream_lands_pages_identically(decode_rig):
    """The pages land through the view (one copy into the pool): the decode's tokens are an uninterrupted
    colocated run's."""
    rig = await decode_rig()
    base, ref, resv = await reserved(rig)
    method = rig.channel.stream_unary("/pdserve.v1.Decode/PushKV", request_serializer=serialize,
                                      response_deserializer=lambda b: b)

    async def gen():
        for c in chunks(resv, PROMPT, ref):
            payload = c.payload
            c.ClearField("payload")
            yield (c, memoryview(payload))

    assert (await refused(method(gen(), timeout=30))).code == grpc.StatusCode.OK
    assert await run_to_end(rig.stub, resv) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]
