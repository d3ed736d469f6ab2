"""Fuzzing the router's gRPC Generate (hypothesis) on a real grpc.aio server over a fake backend.

Stated size: 300 generated GenerateRequest messages (every field, ints over each proto type's full
range) and 200 wire-level messages whose int32 fields carry any 64-bit varint (what a peer that is not
a protobuf library can send: the receiver truncates them), deadline disabled. Every call must end OK
with a STOP/LENGTH finish and at least one token, or with one of the designed statuses, within
CALL_TIMEOUT_S (never INTERNAL/UNKNOWN, never a hang); afterwards the fake backend holds no open request
and the router no in-flight slot.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.pb import common_pb2, router_pb2
from tests.router.harness import CALL_TIMEOUT_S, FUZZ, FakeBackend, LoopThread, RouterRPC

WIRE_EXAMPLES = 200
DESIGNED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.RESOURCE_EXHAUSTED}
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)


@dataclass
class Target:
    loop: LoopThread
    rpc: RouterRPC
    codes: Counter[grpc.StatusCode] = field(default_factory=Counter)

    def call(self, request: bytes) -> tuple[grpc.StatusCode, list[common_pb2.GenerateResponse]]:
        """One Generate with ``request`` sent as raw bytes (any wire content reaches the server)."""
        async def go() -> tuple[grpc.StatusCode, list[common_pb2.GenerateResponse]]:
            method = self.rpc.channel.unary_stream("/pdserve.v1.Router/Generate",
                                                   request_serializer=lambda b: b,
                                                   response_deserializer=common_pb2.GenerateResponse.FromString)
            out: list[common_pb2.GenerateResponse] = []
            try:
                async for m in method(request, timeout=CALL_TIMEOUT_S):
                    out.append(m)
            except grpc.aio.AioRpcError as e:
                return e.code(), out
            return grpc.StatusCode.OK, out
        code, out = self.loop.run(go(), timeout=CALL_TIMEOUT_S + 5)
        self.codes[code] += 1
        return code, out


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    loop = LoopThread()
    rpc = RouterRPC(FakeBackend("fuzz!"), max_inflight=64, request_timeout_s=10.0)
    loop.run(rpc.__aenter__())
    t = Target(loop, rpc)
    try:
        yield t
        async def settle() -> None:
            for _ in range(500):
                if not rpc.backend.open and not rpc.meter.inflight and not rpc.servicer.inflight:
                    return
                await asyncio.sleep(0.01)
        loop.run(settle())
        assert not rpc.backend.open, f"requests left open in the backend: {rpc.backend.open}"
        assert rpc.meter.inflight == 0 and not rpc.servicer.inflight
        assert t.codes[grpc.StatusCode.OK] >= 20 and t.codes[grpc.StatusCode.INVALID_ARGUMENT] >= 20, t.codes
    finally:
        loop.run(rpc.__aexit__(None, None, None))
        loop.close()


def check(code: grpc.StatusCode, out: list[common_pb2.GenerateResponse]) -> None:
    assert code in DESIGNED, code
    if code == grpc.StatusCode.OK:
        assert out and out[-1].finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in out[:-1])
        assert sum(len(m.token_ids) for m in out) >= 1


# --- generated messages ---

text = st.text(max_size=30)  # protobuf strings are valid UTF-8 by construction
params = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.one_of(st.integers(-2, 40), INT32),
    temperature=st.one_of(st.floats(0, 2, width=32), st.floats(width=32)),
    top_k=st.one_of(st.integers(-2, 50), INT32),
    top_p=st.one_of(st.floats(0, 1, width=32), st.floats(width=32)),
    seed=INT64,
    stop=st.lists(text, max_size=3),
    stop_token_ids=st.lists(st.one_of(st.integers(0, 300), INT32), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
)
chat = st.builds(router_pb2.ChatMessages, messages=st.lists(st.builds(
    router_pb2.ChatMessage, role=st.one_of(st.sampled_from(["user", "system", "assistant"]), text),
    content=text), max_size=3), add_generation_prompt=st.booleans())
prompt = st.one_of(
    st.builds(lambda t: {"text": t}, text),
    st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=ids)},
              st.lists(st.one_of(st.integers(0, 300), INT32), max_size=20)),
    st.builds(lambda c: {"chat": c}, chat),
    st.just({}),
)
requests = st.builds(
    lambda p, kw: router_pb2.GenerateRequest(**p, **kw), prompt,
    st.fixed_dictionaries({}, optional={"params": params, "stream": st.booleans(),
                                        "model": st.one_of(st.just("fake"), text),
                                        "request_id": st.one_of(st.just(""), text)}))


@FUZZ
@given(request=requests)
def test_fuzz_generate_messages(target: Target, request: router_pb2.GenerateRequest) -> None:
    check(*target.call(request.SerializeToString()))


# --- wire level: int fields as arbitrary 64-bit varints ---


def varint(v: int) -> bytes:
    v &= (1 << 64) - 1  # negative numbers travel as their 64-bit two's complement
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def submessage(number: int, body: bytes) -> bytes:
    return tag(number, 2) + varint(len(body)) + body


U64 = st.integers(-(2**63), 2**64 - 1)


@st.composite
def wire_requests(draw: Any) -> bytes:
    ints = {n: draw(st.lists(U64, max_size=3)) for n in (1, 3, 5, 7)}  # max_tokens, top_k, seed, stop_token_ids
    sp = b"".join(tag(n, 0) + varint(v) for n, vs in ints.items() for v in vs)
    ids = b"".join(tag(1, 0) + varint(v) for v in draw(st.lists(st.one_of(st.integers(0, 300), U64), max_size=6)))
    msg = submessage(6, sp) + tag(7, 0) + varint(draw(st.integers(0, 2)))
    if draw(st.booleans()):
        msg = submessage(4, ids) + msg
    else:
        msg = submessage(3, draw(text).encode()) + msg
    return msg


@settings(FUZZ, max_examples=WIRE_EXAMPLES)
@given(request=wire_requests())
def test_fuzz_generate_wire_ints(target: Target, request: bytes) -> None:
    check(*target.call(request))


def test_varint_round_trips_through_protobuf() -> None:
    """The wire helper writes what protobuf reads (int32 fields keep the low 32 bits)."""
    raw = submessage(6, tag(3, 0) + varint(2**40 + 7) + tag(1, 0) + varint(-1))
    msg = router_pb2.GenerateRequest.FromString(raw)
    assert (msg.params.top_k, msg.params.max_tokens) == (7, -1)
