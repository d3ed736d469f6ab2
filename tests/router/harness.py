"""Test harness of the router's APIs: an event loop in a thread (servers live there, tests stay
synchronous), raw HTTP exchanges, and a scripted in-process GenerationBackend."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from prometheus_client import CollectorRegistry

from services.common.metrics import (
    ROUTER_ERRORS_TOTAL,
    ROUTER_INFLIGHT_REQUESTS,
    ROUTER_REQUESTS_TOTAL,
    RouterMetrics,
)
from services.common.pb import router_pb2_grpc
from services.router.auth import APIKeys
from services.router.metering import RequestMeter
from services.router.pipeline import BackendError, TextPipeline, TokenEvent
from services.router.servicer import RouterServicer
from services.text.sampling_params import SamplingParams
from services.text.tokenizer import Tokenizer


def outcome_counts(registry: CollectorRegistry, model: str | None = None, *, nonzero: bool = True
                   ) -> dict[str, float]:
    """The router's request outcomes: requests_total as "status/finish_reason", errors_total as "error:code",
    the in-flight gauge as "inflight"; only ``model``'s series when given, only non-zero values when
    ``nonzero``."""
    out: dict[str, float] = {}
    for fam in registry.collect():
        for smp in fam.samples:
            if model is not None and smp.labels.get("model") != model:
                continue
            if smp.name == ROUTER_REQUESTS_TOTAL:
                out[f"{smp.labels['status']}/{smp.labels['finish_reason']}"] = smp.value
            elif smp.name == ROUTER_ERRORS_TOTAL:
                out[f"error:{smp.labels['code']}"] = smp.value
            elif smp.name == ROUTER_INFLIGHT_REQUESTS:
                out["inflight"] = smp.value
    return {k: v for k, v in out.items() if v or not nonzero}


FUZZ_EXAMPLES = 300
"""Examples per fuzzed route or RPC."""
CALL_TIMEOUT_S = 20.0
"""Longest one fuzzed call may take (a hang fails the test)."""
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
"""The fuzz tests' hypothesis settings: reproducible, no per-example deadline (CALL_TIMEOUT_S bounds calls)."""

EOS = 256
"""The byte-level tokenizer: id b < 256 is byte b, 256 is EOS."""


class LoopThread:
    """An event loop in a daemon thread: the aiohttp/gRPC servers live there; tests stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="router-test-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def serve(self, app_factory: Callable[[], web.Application]) -> TestServer:
        async def start() -> TestServer:
            server = TestServer(app_factory(), host="127.0.0.1")
            await server.start_server()
            return server
        return self.run(start())

    def close(self, server: TestServer | None = None) -> None:
        if server is not None:
            self.run(server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Reply:
    status: int
    text: str
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.text)


def http(base: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 60.0) -> Reply:
    """One raw HTTP exchange (aiohttp client on a private loop: the test stays synchronous)."""
    async def go() -> Reply:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, s.request(
                method, f"{base}{path}", data=data, headers=hdrs) as r:
            return Reply(r.status, await r.text(), dict(r.headers))
    return asyncio.run(go())


def sse_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]


class FakeBackend:
    """An in-process GenerationBackend over byte-level token ids.

    Answers every prompt with the bytes of ``reply`` (one token per event, ``delay_s`` apart), finish
    "length" when max_tokens cuts it, else EOS and "stop". ``error`` is raised after ``fail_after``
    tokens (0: before the first); ``finish`` overrides the last event's reason (e.g. "abort");
    ``hang`` waits forever after the reply. Records every request it saw and which are still open."""

    def __init__(self, reply: str = "ok!", *, delay_s: float = 0.0, error: BackendError | None = None,
                 fail_after: int = 0, finish: str | None = None, hang: bool = False) -> None:
        self.reply = list(reply.encode())
        self.delay_s = delay_s
        self.error = error
        self.fail_after = fail_after
        self.finish = finish
        self.hang = hang
        self.open: set[str] = set()
        self.seen: list[str] = []
        self.deadlines: list[float | None] = []
        self.aborted: list[str] = []
        self.entered = asyncio.Event()

    def model_name(self) -> str:
        return "fake"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None) -> AsyncIterator[TokenEvent]:
        self.open.add(request_id)
        self.seen.append(request_id)
        self.deadlines.append(deadline)
        self.entered.set()
        try:
            ids = self.reply[:params.max_tokens]
            reason = "length" if len(ids) == params.max_tokens else "stop"
            if reason == "stop":
                ids.append(EOS)
            for i, t in enumerate(ids):
                if self.error is not None and i == self.fail_after:
                    raise self.error
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                last = i == len(ids) - 1
                if last and self.hang:
                    await asyncio.Event().wait()
                yield TokenEvent([t], [-0.5], finish_reason=(self.finish or reason) if last else None,
                                 prompt_tokens=len(prompt_ids))
        finally:
            self.open.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def fake_pipeline(backend: FakeBackend, max_model_len: int = 256) -> TextPipeline:
    return TextPipeline(Tokenizer.byte_level(EOS), backend, max_model_len)


class RouterRPC:
    """A RouterServicer over ``backend`` on a real grpc.aio server (loopback, ephemeral port), with its
    own registry; ``async with`` it in the loop that runs the calls."""

    def __init__(self, backend: FakeBackend, *, max_inflight: int = 256, api_keys: Sequence[str] = (),
                 request_timeout_s: float = 600.0, max_model_len: int = 256) -> None:
        self.backend = backend
        self.registry = CollectorRegistry()
        self.meter = RequestMeter(RouterMetrics(self.registry), "fake", max_inflight=max_inflight)
        self.servicer = RouterServicer(fake_pipeline(backend, max_model_len), None, "fake", asyncio.Event(),
                                       meter=self.meter, api_keys=APIKeys(api_keys),
                                       request_timeout_s=request_timeout_s)

    async def __aenter__(self) -> RouterRPC:
        self.server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = router_pb2_grpc.RouterStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
        await self.server.stop(None)

    def counts(self) -> dict[str, float]:
        return outcome_counts(self.registry)

    async def settled(self, want: dict[str, float], wait_s: float = 5.0) -> dict[str, float]:
        """The counters once they equal ``want`` (the server counts a call just after its status is sent)."""
        for _ in range(int(wait_s / 0.01)):
            if self.counts() == want:
                break
            await asyncio.sleep(0.01)
        return self.counts()
