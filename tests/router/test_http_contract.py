"""The HTTP API's failure contract over a scripted backend: honest endings (never an
empty 200, no [DONE] after an error, no "abort"), 429/503 with Retry-After, deadlines, API keys, slow
clients, and request accounting read back from a real Prometheus registry."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry

from services.common.config import ConfigError
from services.common.metrics import (
    RouterMetrics,
)
from services.router.auth import APIKeys
from services.router.metering import RequestMeter
from services.router.openai_http import TIMEOUT_HEADER, make_app, make_runner
from services.router.pipeline import BackendError
from tests.router.harness import FakeBackend, fake_pipeline, outcome_counts, sse_events

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_MSG = [{"role": "user", "content": "hi"}]


class Served:
    """A fake-backed app on loopback with its own registry."""

    def __init__(self, backend: FakeBackend, **app_kw: Any) -> None:
        self.backend = backend
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.pipeline = fake_pipeline(backend)
        max_inflight = app_kw.pop("max_inflight", 256)
        self.meter = RequestMeter(self.metrics, "fake", max_inflight=max_inflight)
        self.app = make_app(self.pipeline, meter=self.meter, **app_kw)
        self.client = TestClient(TestServer(self.app, host="127.0.0.1"))

    async def __aenter__(self) -> Served:
        await self.client.start_server()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()

    @property
    def base(self) -> str:
        return str(self.client.make_url("")).rstrip("/")

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
        """(status, JSON body or SSE payloads, headers)."""
        r = await self.client.post(path, json=body, headers=headers)
        text = await r.text()
        if r.headers.get("Content-Type", "").startswith("text/event-stream"):
            return r.status, sse_events(text), r.headers
        return r.status, json.loads(text), r.headers

    def counts(self) -> dict[str, float]:
        return outcome_counts(self.registry)

    async def settled(self, want: dict[str, float]) -> dict[str, float]:
        """The counters once they equal ``want`` (a request is counted just after its last byte)."""
        await until(lambda: self.counts() == want)
        return self.counts()


async def until(check: Callable[[], bool], wait_s: float = 5.0) -> None:
    """Poll ``check`` (state other tasks change) for up to ``wait_s`` seconds."""
    for _ in range(int(wait_s / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)


def body(chat: bool, stream: bool, **extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": "fake", **({"messages": USER_MSG} if chat else {"prompt": "hi"})}
    return {**base, "stream": stream, "max_tokens": 3, **extra}


# --- honest endings ---


@pytest.mark.parametrize(("code", "status", "retry_after"), [
    ("unavailable", 503, "1"), ("resource_exhausted", 429, "1"), ("internal", 500, None),
    ("invalid_argument", 400, None), ("not_found", 404, None), ("deadline_exceeded", 504, "1")])
@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_first_byte_is_an_http_error(code: str, status: int, retry_after: str | None,
                                                          stream: bool) -> None:
    async with Served(FakeBackend(error=BackendError(code, f"backend says {code}"))) as s:
        got, err, headers = await s.post(COMPLETIONS, body(False, stream))
        assert got == status
        assert err["error"]["code"] == code and code in err["error"]["message"]
        assert headers.get("Retry-After") == retry_after
        assert await s.settled({"error/error": 1, f"error:{code}": 1}) == {"error/error": 1, f"error:{code}": 1}


async def test_retry_after_rounds_the_backends_hint_up() -> None:
    err = BackendError("resource_exhausted", "decode full", retry_after_s=2.2)
    async with Served(FakeBackend(error=err)) as s:
        status, _, headers = await s.post(CHAT, body(True, False))
        assert (status, headers["Retry-After"]) == (429, "3")


@pytest.mark.parametrize("chat", [False, True])
async def test_aborted_backend_is_503_never_an_empty_200(chat: bool) -> None:
    async with Served(FakeBackend("a", finish="abort")) as s:  # the only token ends in "abort"
        status, err, headers = await s.post(CHAT if chat else COMPLETIONS, body(chat, False, max_tokens=1))
        assert status == 503 and err["error"]["code"] == "unavailable"
        assert headers["Retry-After"] == "1"
        assert not s.backend.open


@pytest.mark.parametrize("chat", [False, True])
async def test_failure_mid_stream_is_an_sse_error_without_done(chat: bool) -> None:
    async with Served(FakeBackend("abcdef", error=BackendError("unavailable", "decode died"), fail_after=2)) as s:
        status, events, _ = await s.post(CHAT if chat else COMPLETIONS, body(chat, True, max_tokens=6))
        assert status == 200
        assert "[DONE]" not in events
        last = json.loads(events[-1])
        assert last["error"]["code"] == "unavailable" and "decode died" in last["error"]["message"]
        chunks = [json.loads(e) for e in events[:-1]]
        text = "".join((c["choices"][0].get("delta", {}).get("content") or c["choices"][0].get("text") or "")
                       for c in chunks)
        assert text == "ab"
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert await s.settled({"error/error": 1, "error:unavailable": 1}) == {"error/error": 1,
                                                                                "error:unavailable": 1}


async def test_abort_mid_stream_never_shows_abort() -> None:
    async with Served(FakeBackend("abc", finish="abort")) as s:
        status, events, _ = await s.post(COMPLETIONS, body(False, True))
        assert status == 200 and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "unavailable"
        assert all('"abort"' not in e for e in events)


async def test_unexpected_exception_is_a_json_500_or_sse_error() -> None:
    class Broken(FakeBackend):
        async def generate(self, *a: Any, **k: Any) -> AsyncIterator[Any]:  # type: ignore[override]
            async for ev in super().generate(*a, **k):
                yield ev
                raise RuntimeError("bug")

    async with Served(Broken("abc")) as s:
        status, events, _ = await s.post(COMPLETIONS, body(False, True))
        assert status == 200 and json.loads(events[-1])["error"]["code"] == "internal" and "[DONE]" not in events
        status, err, _ = await s.post(COMPLETIONS, body(False, False))
        assert status == 500 and err["error"]["code"] == "internal"
        assert await s.settled({"error/error": 2, "error:internal": 2}) == {"error/error": 2, "error:internal": 2}


async def test_official_client_sees_the_mid_stream_error() -> None:
    async with Served(FakeBackend("abcdef", error=BackendError("internal", "engine died"), fail_after=3)) as s:
        client = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="x", max_retries=0)
        stream = await client.completions.create(model="fake", prompt="hi", max_tokens=6, stream=True)
        seen = ""
        with pytest.raises(openai.APIError, match="engine died"):
            async for c in stream:
                seen += c.choices[0].text
        assert seen == "abc"
        await client.close()


async def test_completed_requests_are_ok_with_their_finish_reason() -> None:
    async with Served(FakeBackend("abc")) as s:
        for chat in (False, True):
            status, events, _ = await s.post(CHAT if chat else COMPLETIONS, body(chat, True))
            assert status == 200 and events[-1] == "[DONE]"
            status, full, _ = await s.post(COMPLETIONS, body(False, False, max_tokens=10))
            assert status == 200 and full["choices"][0]["finish_reason"] == "stop"
        assert await s.settled({"ok/length": 2, "ok/stop": 2}) == {"ok/length": 2, "ok/stop": 2}


# --- deadlines ---


async def test_non_stream_past_its_deadline_is_504() -> None:
    async with Served(FakeBackend("abc", hang=True)) as s:
        t0 = time.time()
        status, err, _ = await s.post(COMPLETIONS, body(False, False), headers={TIMEOUT_HEADER: "0.3"})
        assert status == 504 and err["error"]["code"] == "deadline_exceeded"
        assert err["error"]["type"] == "timeout_error"
        (deadline,) = s.backend.deadlines
        assert deadline is not None and t0 + 0.25 < deadline < t0 + 1.0  # Unix seconds, handed down
        assert not s.backend.open and s.backend.aborted
        assert await s.settled({"error/error": 1, "error:deadline_exceeded": 1}) == {
            "error/error": 1, "error:deadline_exceeded": 1}


async def test_stream_past_its_deadline_ends_with_an_sse_error() -> None:
    async with Served(FakeBackend("abc", hang=True)) as s:
        status, events, _ = await s.post(CHAT, body(True, True), headers={TIMEOUT_HEADER: "0.3"})
        assert status == 200 and "[DONE]" not in events
        assert json.loads(events[-1])["error"]["code"] == "deadline_exceeded"


async def test_request_timeout_bounds_the_deadline_and_the_header_is_checked() -> None:
    async with Served(FakeBackend("abc"), request_timeout_s=5.0) as s:
        t0 = time.time()
        assert (await s.post(COMPLETIONS, body(False, False), headers={TIMEOUT_HEADER: "1e9"}))[0] == 200
        assert (await s.post(COMPLETIONS, body(False, False)))[0] == 200
        assert all(d is not None and d <= t0 + 6.0 for d in s.backend.deadlines)
        for bad in ("abc", "0", "-3", "inf", "nan"):
            status, err, _ = await s.post(COMPLETIONS, body(False, False), headers={TIMEOUT_HEADER: bad})
            assert status == 400 and err["error"]["param"] == TIMEOUT_HEADER, bad


# --- backpressure ---


async def test_past_max_inflight_is_429_with_retry_after() -> None:
    backend = FakeBackend("ab", hang=True)
    async with Served(backend, max_inflight=2) as s:
        held = [asyncio.create_task(s.post(COMPLETIONS, body(False, False))) for _ in range(2)]
        await until(lambda: len(backend.open) == 2)
        status, err, headers = await s.post(CHAT, body(True, True))
        assert (status, err["error"]["code"], err["error"]["type"]) == (429, "resource_exhausted", "rate_limit_error")
        assert headers["Retry-After"] == "1"
        assert len(backend.seen) == 2  # refused before any work
        assert s.counts()["inflight"] == 2
        for t in held:
            t.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        await until(lambda: not backend.open and not s.meter.inflight)
        backend.hang = False
        assert (await s.post(COMPLETIONS, body(False, False)))[0] == 200
        want = {"error/error": 1, "error:resource_exhausted": 1, "cancelled/cancelled": 2, "ok/stop": 1}
        assert await s.settled(want) == want


# --- API keys ---


async def test_api_keys_guard_v1_and_leave_probes_open() -> None:
    async with Served(FakeBackend("abc"), api_keys=APIKeys(["k-one", "k-two"])) as s:
        for hdr in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k-one"},
                    {"Authorization": "Basic k-one"}, {"Authorization": "Bearer k-one-and-more"}):
            for path, method in ((COMPLETIONS, "POST"), (CHAT, "POST"), ("/v1/models", "GET"), ("/v1/nope", "GET")):
                r = await s.client.request(method, path, json=body(path == CHAT, False), headers=hdr)
                assert r.status == 401, (hdr, path)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                err = (await r.json())["error"]
                assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
        for path in ("/health", "/ready"):
            assert (await s.client.get(path)).status == 200
        assert (await s.post(COMPLETIONS, body(False, False), headers={"Authorization": "Bearer k-two"}))[0] == 200
        assert (await s.post(CHAT, body(True, False), headers={"Authorization": "bearer k-one"}))[0] == 200
        ok = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="k-one", max_retries=0)
        assert (await ok.completions.create(model="fake", prompt="hi", max_tokens=2)).choices[0].text == "ab"
        bad = openai.AsyncOpenAI(base_url=f"{s.base}/v1", api_key="k-three", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model="fake", prompt="hi", max_tokens=2)
        await ok.close()
        await bad.close()
        want = {"error/error": 11, "error:unauthenticated": 11, "ok/length": 3}
        assert await s.settled(want) == want


def test_api_keys_load(tmp_path: Any) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nalpha\n\n  beta  \n")
    keys = APIKeys.load("gamma", str(f))
    assert all(keys.allows(f"Bearer {k}") for k in ("alpha", "beta", "gamma"))
    assert not keys.allows("Bearer team") and not keys.allows(None) and not keys.allows("Bearer \ud800")
    assert not APIKeys.load().required and APIKeys.load().allows(None)
    (tmp_path / "empty").write_text("# nothing\n")
    for bad in (str(tmp_path / "empty"), str(tmp_path / "missing")):
        with pytest.raises(ConfigError, match="api-key-file"):
            APIKeys.load("", bad)


# --- slow clients ---


async def _raw_exchange(port: int, data: bytes, wait_s: float) -> bytes:
    """Send ``data`` and read until the server closes the connection (or ``wait_s`` passes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    got = b""
    try:
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        got += b"<still open>"
    writer.close()
    return got


async def test_slow_clients_cannot_hold_a_connection() -> None:
    app = make_app(fake_pipeline(FakeBackend("abc")), read_timeout_s=0.3)
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        # A head that never completes: the connection is closed, no handler ever ran.
        t0 = time.monotonic()
        got = await _raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", wait_s=5.0)
        assert b"<still open>" not in got and time.monotonic() - t0 < 4.0
        # A body that never completes: 408 with a JSON error, then the connection is closed.
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        got = await _raw_exchange(port, head + b'{"prompt": ', wait_s=5.0)
        assert got.startswith(b"HTTP/1.1 408"), got[:200]
        assert b'"request_timeout"' in got and b"<still open>" not in got
        # A prompt client is unaffected.
        got = await _raw_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", wait_s=5.0)
        assert got.startswith(b"HTTP/1.1 200")
    finally:
        await runner.cleanup()

