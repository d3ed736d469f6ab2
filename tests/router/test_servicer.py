"""The router's gRPC API over a scripted backend on a real grpc.aio server: honest endings (STOP/LENGTH
or a status with a typed ErrorDetail, never ABORT), RESOURCE_EXHAUSTED past the in-flight bound, the
gRPC deadline as the request's deadline, API keys, input checks, and the accounting."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.common.grpc_util import Reason, detail_of
from services.common.pb import common_pb2, router_pb2
from services.router.pipeline import BackendError
from tests.router.harness import FakeBackend, RouterRPC

AUTH = (("authorization", "Bearer sesame"),)


def text_request(text: str = "hi", *, stream: bool = True, max_tokens: int = 3, **params: object
                 ) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text=text, stream=stream,
                                      params=common_pb2.SamplingParams(max_tokens=max_tokens, **params))


async def failure(call: grpc.aio.UnaryStreamCall) -> grpc.aio.AioRpcError:
    """Drain a call that must fail; returns its error."""
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        async for _ in call:
            pass
    return ei.value


async def test_completed_stream_and_unary_forms() -> None:
    async with RouterRPC(FakeBackend("abc")) as r:
        msgs = [m async for m in r.stub.Generate(text_request(max_tokens=3))]
        assert "".join(m.text for m in msgs) == "abc"
        assert [m.finish_reason for m in msgs] == [0, 0, common_pb2.FINISH_REASON_LENGTH]
        (one,) = [m async for m in r.stub.Generate(text_request(stream=False, max_tokens=10))]
        assert (one.text, one.finish_reason, one.usage.completion_tokens) == ("abc", common_pb2.FINISH_REASON_STOP, 4)
        want = {"ok/length": 1, "ok/stop": 1}
        assert await r.settled(want) == want


@pytest.mark.parametrize("stream", [True, False])
async def test_aborted_backend_is_unavailable_never_abort(stream: bool) -> None:
    async with RouterRPC(FakeBackend("abc", finish="abort")) as r:
        seen: list[common_pb2.GenerateResponse] = []
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async for m in r.stub.Generate(text_request(stream=stream)):
                seen.append(m)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        d = detail_of(ei.value)
        assert d.retryable and d.retry_after_ms == 1000 and d.side == "router"
        assert all(m.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for m in seen)
        assert "".join(m.text for m in seen) == ("ab" if stream else "")
        want = {"error/error": 1, "error:unavailable": 1}
        assert await r.settled(want) == want


@pytest.mark.parametrize(("code", "status"), [
    ("unavailable", grpc.StatusCode.UNAVAILABLE), ("resource_exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("internal", grpc.StatusCode.INTERNAL), ("invalid_argument", grpc.StatusCode.INVALID_ARGUMENT),
    ("not_found", grpc.StatusCode.NOT_FOUND), ("deadline_exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)])
async def test_backend_errors_keep_their_status(code: str, status: grpc.StatusCode) -> None:
    async with RouterRPC(FakeBackend(error=BackendError(code, "backend says no", retry_after_s=2.0))) as r:
        err = await failure(r.stub.Generate(text_request()))
        assert err.code() == status and "backend says no" in (err.details() or "")
        d = detail_of(err)
        assert d.retry_after_ms == (2000 if code in ("unavailable", "resource_exhausted", "deadline_exceeded") else 0)
        want = {"error/error": 1, f"error:{code}": 1}
        assert await r.settled(want) == want


async def test_past_max_inflight_is_resource_exhausted() -> None:
    backend = FakeBackend("ab", hang=True)
    async with RouterRPC(backend, max_inflight=2) as r:
        calls = [r.stub.Generate(text_request(max_tokens=2)) for _ in range(2)]
        firsts = [await c.read() for c in calls]  # both admitted and streaming
        assert [m.text for m in firsts] == ["a", "a"]
        err = await failure(r.stub.Generate(text_request()))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        d = detail_of(err)
        assert (d.reason, d.retryable, d.retry_after_ms) == (Reason.ERROR_REASON_OVERLOADED, True, 1000)
        assert len(backend.seen) == 2
        for c in calls:
            c.cancel()
        for _ in range(500):
            if not backend.open and not r.meter.inflight:
                break
            await asyncio.sleep(0.01)
        assert not backend.open and r.meter.inflight == 0
        want = {"error/error": 1, "error:resource_exhausted": 1, "cancelled/cancelled": 2}
        assert await r.settled(want) == want


async def test_grpc_deadline_is_the_requests_deadline() -> None:
    backend = FakeBackend("abc", hang=True)
    async with RouterRPC(backend) as r:
        t0 = time.time()
        err = await failure(r.stub.Generate(text_request(), timeout=0.5))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        (deadline,) = backend.deadlines
        assert deadline is not None and t0 + 0.3 < deadline < t0 + 0.5  # handed down, Unix seconds
        assert not backend.open
        want = {"error/error": 1, "error:deadline_exceeded": 1}
        assert await r.settled(want) == want


async def test_request_timeout_bounds_calls_without_a_deadline() -> None:
    async with RouterRPC(FakeBackend("abc", hang=True), request_timeout_s=0.3) as r:
        err = await failure(r.stub.Generate(text_request(stream=False)))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert detail_of(err).reason == Reason.ERROR_REASON_DEADLINE


async def test_api_keys() -> None:
    async with RouterRPC(FakeBackend("abc"), api_keys=["sesame"]) as r:
        for md in ((), (("authorization", "Bearer open"),), (("authorization", "sesame"),)):
            err = await failure(r.stub.Generate(text_request(), metadata=md))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await r.stub.Abort(common_pb2.AbortRequest(request_id="x"), metadata=md)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        msgs = [m async for m in r.stub.Generate(text_request(), metadata=AUTH)]
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert not (await r.stub.Abort(common_pb2.AbortRequest(request_id="x"), metadata=AUTH)).found
        want = {"error/error": 3, "error:unauthenticated": 3, "ok/length": 1}
        assert await r.settled(want) == want


BAD = [
    (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, 257])), "token_ids", "vocabulary"),
    (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, -4])), "token_ids", "vocabulary"),
    (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[])), "token_ids", "empty"),
    (router_pb2.GenerateRequest(), "prompt", "one of"),
    (router_pb2.GenerateRequest(text=""), "text", "empty"),
    (router_pb2.GenerateRequest(text="x" * (256 * 16 + 1)), "text", "characters"),
    (text_request(stop_token_ids=[2**31 - 1]), "stop_token_ids", "vocabulary"),
    (text_request(top_k=-(2**31)), "top_k", "top_k"),
    (text_request(max_tokens=-5), "max_tokens", "> 0"),
    (text_request(max_tokens=2**31 - 1), "max_tokens", "context"),
    (text_request(temperature=float("inf")), "temperature", "finite"),
    (text_request(temperature=float("nan")), "temperature", "temperature"),
    (router_pb2.GenerateRequest(chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(content="x")])),
     "chat.messages[0].role", "empty"),
]


@pytest.mark.parametrize(("request_", "field", "words"), BAD, ids=[f"{f}-{i}" for i, (_, f, _) in enumerate(BAD)])
async def test_bad_input_is_invalid_argument_naming_the_field(request_: router_pb2.GenerateRequest, field: str,
                                                              words: str) -> None:
    async with RouterRPC(FakeBackend("abc")) as r:
        err = await failure(r.stub.Generate(request_))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert words in (err.details() or "")
        d = detail_of(err)
        assert (d.reason, d.field) == (Reason.ERROR_REASON_INVALID_INPUT, field)
        assert not r.backend.seen
        want = {"error/error": 1, "error:invalid_argument": 1}
        assert await r.settled(want) == want


async def test_wrong_model_and_duplicate_request_id() -> None:
    async with RouterRPC(FakeBackend("abc", hang=True)) as r:
        err = await failure(r.stub.Generate(router_pb2.GenerateRequest(text="hi", model="gpt-4")))
        assert err.code() == grpc.StatusCode.NOT_FOUND and "gpt-4" in (err.details() or "")
        first = r.stub.Generate(router_pb2.GenerateRequest(text="hi", request_id="dup", stream=True,
                                                           params=common_pb2.SamplingParams(max_tokens=3)))
        assert (await first.read()).text == "a"
        err = await failure(r.stub.Generate(router_pb2.GenerateRequest(text="hi", request_id="dup")))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS
        assert (await r.stub.Abort(common_pb2.AbortRequest(request_id="dup"))).found
        first.cancel()
        assert r.counts()["error:not_found"] == 1 and r.counts()["error:already_exists"] == 1
