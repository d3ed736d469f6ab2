"""The OpenAI HTTP API end to end on loopback: the official client against a real engine on the
embedded default model (loaded once per module), plus raw HTTP for every bad-input case."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from services.common.metrics import ROUTER_TTFT_SECONDS, RouterMetrics
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.sampling_params import SamplingParams
from services.engine.tokenizer import Tokenizer
from services.router.local_backend import LocalEngineBackend
from services.router.openai_http import make_app
from services.router.pipeline import BackendError, TextPipeline, TokenEvent

QUESTION = "What is the capital of France?"


class LoopThread:
    """An event loop in a daemon thread: the aiohttp servers live there; tests stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http-test-loop", daemon=True)
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

    def stop(self, server: TestServer) -> None:
        self.run(server.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@dataclass
class Served:
    engine: AsyncEngine
    pipeline: TextPipeline
    loop: LoopThread
    base: str
    free_blocks: float
    """Free KV blocks of the idle engine at start: every request must give all of its blocks back."""
    registry: CollectorRegistry

    @property
    def model(self) -> str:
        return self.pipeline.model_name()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=120)

    def stats(self) -> dict[str, float]:
        return self.loop.run(self.engine.stats())

    def wait_idle(self, timeout: float = 30.0) -> tuple[float, float, float]:
        """(running, waiting, free blocks) once back to idle, or as they are at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats()
            got = (s["running"], s["waiting"], s["free_blocks"])
            if got == (0, 0, self.free_blocks) or time.monotonic() > deadline:
                return got
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = AsyncEngine(EngineConfig(dtype="float32", kv_cache_bytes=64 << 20))
    pipeline = TextPipeline(engine.tokenizer, LocalEngineBackend(engine), engine.engine.max_model_len)
    loop, registry = LoopThread(), CollectorRegistry()
    server = loop.serve(lambda: make_app(pipeline, metrics=RouterMetrics(registry)))
    try:
        free = loop.run(engine.stats())["free_blocks"]
        yield Served(engine, pipeline, loop, f"http://127.0.0.1:{server.port}", free, registry)
    finally:
        loop.stop(server)
        engine.shutdown()


@dataclass
class Reply:
    status: int
    text: str

    def json(self) -> Any:
        return json.loads(self.text)


def http(base: str, method: str, path: str, body: Any = None, *, raw: bytes | None = None) -> Reply:
    """One raw HTTP exchange (aiohttp client on a private loop: the test stays synchronous)."""
    async def go() -> Reply:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        async with aiohttp.ClientSession() as s, s.request(
                method, f"{base}{path}", data=data, headers={"Content-Type": "application/json"}) as r:
            return Reply(r.status, await r.text())
    return asyncio.run(go())


def chat_ids(served: Served, text: str) -> list[int]:
    return served.pipeline.encode_chat([{"role": "user", "content": text}])


def test_models_health_ready(served: Served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == [served.model]
    assert http(served.base, "GET", "/health").json() == {"status": "ok"}
    assert http(served.base, "GET", "/ready").status == 200


def test_chat_greedy_answers_paris(served: Served) -> None:
    r = served.client().chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.created > 0
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(chat_ids(served, QUESTION))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 40
    # The same prompt again reuses its full KV blocks (prefix cache) and says so.
    again = served.client().chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=40)
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    ttft = served.registry.get_sample_value(f"{ROUTER_TTFT_SECONDS}_count", {"model": served.model})
    assert ttft is not None and ttft >= 2


def test_chat_stream_matches_non_stream(served: Served) -> None:
    client = served.client()
    msgs = [{"role": "user", "content": QUESTION}]
    full = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=30)
    chunks = list(client.chat.completions.create(
        model=served.model, messages=msgs, temperature=0, max_tokens=30, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content and "Paris" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_length_and_usage(served: Served) -> None:
    prompt = "The quick brown fox"
    r = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(served.engine.tokenizer.encode(prompt))
    stream = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=5, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_with_token_id_prompt(served: Served) -> None:
    ids = served.engine.tokenizer.encode("Once upon a time")
    by_ids = served.client().completions.create(model=served.model, prompt=ids, max_tokens=6, temperature=0)
    by_text = served.client().completions.create(model=served.model, prompt="Once upon a time", max_tokens=6,
                                                 temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates(served: Served, stream: bool) -> None:
    client = served.client()
    msgs = [{"role": "user", "content": QUESTION}]
    base = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=40)
    content = base.choices[0].message.content or ""
    assert "Paris" in content
    if stream:
        chunks = list(client.chat.completions.create(model=served.model, messages=msgs, temperature=0,
                                                     max_tokens=40, stop=["Paris"], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(model=served.model, messages=msgs, temperature=0, max_tokens=40,
                                           stop=["Paris", "never-appears"])
        text, finish = r.choices[0].message.content or "", r.choices[0].finish_reason
    assert text == content[:content.index("Paris")]
    assert finish == "stop"
    assert served.wait_idle() == (0, 0, served.free_blocks)


def test_logprobs_shapes(served: Served) -> None:
    client = served.client()
    r = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                                       temperature=0, max_tokens=4, logprobs=True)
    content = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and r.usage is not None and len(content) == r.usage.completion_tokens
    assert all(e.logprob <= 0 and isinstance(e.token, str) for e in content)
    c = client.completions.create(model=served.model, prompt="Hello", max_tokens=3, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 3
    assert "".join(lp.tokens) == c.choices[0].text
    assert all(v is not None and v <= 0 for v in lp.token_logprobs)


# --- bad input: every case names its field and the server keeps serving ---

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER_MSG = [{"role": "user", "content": "hi"}]

BAD_REQUESTS = [
    # (route, body, status, param, words the message must contain)
    (CHAT, {"messages": USER_MSG, "max_tokens": "ten"}, 400, "max_tokens", ["max_tokens", "integer"]),
    (CHAT, {"messages": USER_MSG, "temperature": "hot"}, 400, "temperature", ["temperature"]),
    (CHAT, {"messages": "hi"}, 400, "messages", ["messages", "list"]),
    (CHAT, {"messages": []}, 400, "messages", ["messages"]),
    (CHAT, {}, 400, "messages", ["messages", "required"]),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", ["role"]),
    (CHAT, {"messages": [{"role": "user"}]}, 400, "messages[0].content", ["content"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", ["wizard"]),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", ["content"]),
    (CHAT, {"messages": USER_MSG, "max_tokens": 0}, 400, "max_tokens", ["max_tokens", "> 0"]),
    (CHAT, {"messages": USER_MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens", ["> 0"]),
    (CHAT, {"messages": USER_MSG, "temperature": -0.5}, 400, "temperature", [">= 0"]),
    (CHAT, {"messages": USER_MSG, "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    (CHAT, {"messages": USER_MSG, "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    (CHAT, {"messages": USER_MSG, "top_k": -2}, 400, "top_k", ["top_k"]),
    (CHAT, {"messages": USER_MSG, "n": 2}, 400, "n", ["n=1"]),
    (CHAT, {"messages": USER_MSG, "stop": 7}, 400, "stop", ["stop"]),
    (CHAT, {"messages": USER_MSG, "seed": "x"}, 400, "seed", ["seed"]),
    (CHAT, {"messages": USER_MSG, "logprobs": "yes"}, 400, "logprobs", ["logprobs"]),
    (CHAT, {"messages": USER_MSG, "stream_options": {"include_usage": True}}, 400, "stream_options", ["stream"]),
    (CHAT, {"messages": USER_MSG, "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    (CHAT, {"messages": USER_MSG, "max_tokens": 100_000}, 400, "max_tokens", ["100000", "8192"]),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", ["2 prompts"]),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", ["empty"]),
    (COMPLETIONS, {}, 400, "prompt", ["required"]),
    (COMPLETIONS, {"prompt": {"x": 1}}, 400, "prompt", ["prompt"]),
    (COMPLETIONS, {"prompt": [1, -2]}, 400, "prompt", ["non-negative"]),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", ["vocabulary"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", ["> 0"]),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 9}, 400, "logprobs", ["logprobs"]),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": 1.0}, 400, "frequency_penalty", ["not supported"]),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), BAD_REQUESTS,
                         ids=[f"{r.rsplit('/', 1)[-1]}-{p}-{i}" for i, (r, _, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_request(served: Served, route: str, body: dict[str, Any], status: int, param: str,
                     words: list[str]) -> None:
    r = http(served.base, "POST", route, body)
    assert r.status == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_unknown_model_names_both(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as ei:
        served.client().chat.completions.create(model="nope", messages=USER_MSG)  # type: ignore[arg-type]
    err = ei.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_found"
    assert "nope" in err["message"] and served.model in err["message"]


def test_oversize_prompt_names_token_counts(served: Served) -> None:
    prompt = "hello " * 9000
    n = len(served.engine.tokenizer.encode(prompt))
    r = http(served.base, "POST", COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
    assert r.status == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(n) in err["message"] and "8192" in err["message"]


def test_malformed_json_wrong_body_type_and_oversize_body(served: Served) -> None:
    r = http(served.base, "POST", CHAT, None, raw=b'{"messages": [')
    assert r.status == 400 and "JSON" in r.json()["error"]["message"]
    r = http(served.base, "POST", CHAT, [1, 2])
    assert r.status == 400 and "object" in r.json()["error"]["message"]
    big = json.dumps({"prompt": "x" * (5 << 20)}).encode()
    r = http(served.base, "POST", COMPLETIONS, None, raw=big)
    assert r.status == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_json_errors(served: Served) -> None:
    r = http(served.base, "GET", "/v1/nope")
    assert r.status == 404 and "error" in r.json()
    r = http(served.base, "GET", "/v1/completions")
    assert r.status == 405 and "error" in r.json()


def test_still_serves_after_bad_requests(served: Served) -> None:
    for route, body, *_ in BAD_REQUESTS[:5]:
        http(served.base, "POST", route, body)
    r = served.client().completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


# --- client disconnects cancel generation ---


def test_disconnect_mid_stream_aborts(served: Served) -> None:
    body = {"model": served.model, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": 4000, "ignore_eos": True, "stream": True}

    async def read_a_few_then_hang_up() -> int:
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{served.base}{CHAT}", json=body)
            assert r.status == 200
            seen = 0
            async for line in r.content:
                seen += line.startswith(b"data: ")
                if seen >= 4:
                    break
            r.close()  # drops the connection mid-stream
            return seen

    assert asyncio.run(read_a_few_then_hang_up()) == 4
    assert served.wait_idle() == (0, 0, served.free_blocks)


def test_disconnect_while_waiting_non_stream_aborts(served: Served) -> None:
    body = {"model": served.model, "prompt": "Write a long essay.", "max_tokens": 4000, "ignore_eos": True}

    async def give_up_after_a_second() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            await s.post(f"{served.base}{COMPLETIONS}", json=body)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(give_up_after_a_second())
    assert served.wait_idle() == (0, 0, served.free_blocks)



class FailingBackend:
    def __init__(self, error: BackendError) -> None:
        self.error = error

    def model_name(self) -> str:
        return "fake"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenEvent]:
        raise self.error
        yield TokenEvent([], [])  # an async generator that fails on first use

    async def abort(self, request_id: str) -> None: ...


@pytest.mark.parametrize(("code", "status"), [("unavailable", 503), ("resource_exhausted", 429),
                                               ("internal", 500), ("invalid_argument", 400), ("not_found", 404)])
def test_backend_errors_map_to_status(code: str, status: int) -> None:
    pipeline = TextPipeline(Tokenizer.byte_level(256), FailingBackend(BackendError(code, f"backend says {code}")), 128)
    loop = LoopThread()
    server = loop.serve(lambda: make_app(pipeline, ready=lambda: False))
    base = f"http://127.0.0.1:{server.port}"
    try:
        for stream in (False, True):
            r = http(base, "POST", COMPLETIONS, {"prompt": "hi", "stream": stream})
            assert r.status == status, r.text
            assert r.json()["error"]["code"] == code and code in r.json()["error"]["message"]
        assert http(base, "GET", "/ready").status == 503
    finally:
        loop.stop(server)
