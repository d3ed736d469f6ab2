"""The OpenAI HTTP API end to end on loopback: the official client against a real engine on the
embedded default model (loaded once per module), plus raw HTTP for every bad-input case."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import (
    ROUTER_TTFT_SECONDS,
    RouterMetrics,
)
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.router.openai_http import make_app
from services.router.pipeline import TextPipeline
from tests.router.harness import LoopThread, http, outcome_counts
from tests.router.local_backend import LocalEngineBackend

QUESTION = "What is the capital of France?"


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
        loop.close(server)
        engine.shutdown()


def eventually(check: Any, timeout: float = 10.0) -> Any:
    """Poll ``check()`` until truthy (a server counts a request just after its last byte is sent)."""
    deadline = time.monotonic() + timeout
    while not (got := check()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def counts(served: Served) -> dict[str, float]:
    return outcome_counts(served.registry, served.model, nonzero=False)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)
            if k != "inflight" and after.get(k, 0.0) != before.get(k, 0.0)}


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
    (CHAT, {"messages": USER_MSG, "temperature": -0.5}, 400, "temperature", ["[0, 2]"]),
    (CHAT, {"messages": USER_MSG, "temperature": 2.5}, 400, "temperature", ["[0, 2]"]),
    (CHAT, {"messages": USER_MSG, "model": None}, 400, "model", ["required"]),
    (COMPLETIONS, {"prompt": "hi", "model": None}, 400, "model", ["required"]),
    (CHAT, {"messages": USER_MSG, "top_p": 0}, 400, "top_p", ["(0, 1]"]),
    (CHAT, {"messages": USER_MSG, "top_p": 1.5}, 400, "top_p", ["(0, 1]"]),
    (CHAT, {"messages": USER_MSG, "top_k": -2}, 400, "top_k", ["top_k"]),
    (CHAT, {"messages": USER_MSG, "n": 2}, 400, "n", ["n=1"]),
    (CHAT, {"messages": USER_MSG, "stop": 7}, 400, "stop", ["stop"]),
    (CHAT, {"messages": USER_MSG, "seed": "x"}, 400, "seed", ["seed"]),
    (CHAT, {"messages": USER_MSG, "logprobs": "yes"}, 400, "logprobs", ["logprobs"]),
    (CHAT, {"messages": USER_MSG, "stream_options": {"include_usage": True}}, 400, "stream_options", ["stream"]),
    (CHAT, {"messages": USER_MSG, "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    (CHAT, {"messages": USER_MSG, "max_tokens": 100_000}, 400, "messages", ["100000", "8192"]),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", ["2 prompts"]),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", ["empty"]),
    (COMPLETIONS, {}, 400, "prompt", ["required"]),
    (COMPLETIONS, {"prompt": {"x": 1}}, 400, "prompt", ["prompt"]),
    (COMPLETIONS, {"prompt": [1, -2]}, 400, "prompt", ["non-negative"]),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt", ["vocabulary"]),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", ["> 0"]),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, 400, "logprobs", ["20"]),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": 1.0}, 400, "frequency_penalty", ["not supported"]),
    # Hostile input: each of these answered a plain-text 500 once.
    (CHAT, {"messages": USER_MSG, "top_k": 2**31}, 400, "top_k", ["top_k", str(2**31 - 1)]),
    (CHAT, {"messages": USER_MSG, "top_k": 2**70}, 400, "top_k", ["top_k"]),
    (CHAT, {"messages": USER_MSG, "seed": 2**64}, 400, "seed", ["seed"]),
    (CHAT, {"messages": USER_MSG, "seed": -(2**64)}, 400, "seed", ["seed"]),
    (CHAT, {"messages": USER_MSG, "stop_token_ids": [2**31]}, 400, "stop_token_ids", ["stop_token_ids"]),
    (CHAT, {"messages": USER_MSG, "stop_token_ids": [-1]}, 400, "stop_token_ids", ["stop_token_ids"]),
    (CHAT, {"messages": USER_MSG, "stop_token_ids": [10**6]}, 400, "stop_token_ids", ["vocabulary"]),
    (COMPLETIONS, {"prompt": [2**31]}, 400, "prompt", ["token ids"]),
    (COMPLETIONS, {"prompt": [1, 2**40]}, 400, "prompt", ["token ids"]),
    (COMPLETIONS, {"prompt": [[1, -5]]}, 400, "prompt", ["token ids"]),
    (CHAT, {"messages": USER_MSG, "max_tokens": 10**30}, 400, "max_tokens", ["max_tokens"]),
    (CHAT, {"messages": USER_MSG, "max_tokens": 1e300}, 400, "max_tokens", ["max_tokens"]),
    (CHAT, {"messages": USER_MSG, "temperature": 10**400}, 400, "temperature", ["finite"]),
    (COMPLETIONS, {"prompt": "a\ud800b"}, 400, "prompt", ["surrogate"]),
    (CHAT, {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages", ["surrogate"]),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}, 400, "messages",
     ["surrogate"]),
    (CHAT, {"messages": USER_MSG, "stop": ["ok", "\udc80"]}, 400, "stop", ["surrogate"]),
    (CHAT, {"messages": USER_MSG, "metadata": {"\ud800": 1}}, 400, "metadata", ["surrogate"]),
    (CHAT, {"messages": USER_MSG, "metadata": json.loads("[" * 80 + "]" * 80)}, 400, "metadata", ["64"]),
    (CHAT, {"messages": [{"role": ["user"], "content": "hi"}]}, 400, "messages[0].role", ["role"]),
    (CHAT, {"messages": [{"role": 7, "content": "hi"}]}, 400, "messages[0].role", ["role"]),
    (CHAT, {"messages": [{"role": "user", "content": [1, 2]}]}, 400, "messages[0].content[0]", ["text"]),
    (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}, 400, "messages[0].content", ["string"]),
    (CHAT, {"messages": [["user", "hi"]]}, 400, "messages[0]", ["object"]),
    (CHAT, {"messages": USER_MSG, "model": ["gpt"]}, 400, "model", ["string"]),
    (CHAT, {"messages": USER_MSG, "stop": [["a"]]}, 400, "stop", ["stop"]),
    (CHAT, {"messages": USER_MSG, "n": "2"}, 400, "n", ["integer"]),
    (CHAT, {"messages": USER_MSG, "n": 5}, 400, "n", ["n=1"]),
    (CHAT, {"messages": USER_MSG, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", ["20"]),
    (CHAT, {"messages": USER_MSG, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options.include_usage", ["boolean"]),
    (CHAT, {"messages": USER_MSG, "stream": "yes"}, 400, "stream", ["boolean"]),
    (COMPLETIONS, {"prompt": "x" * (8192 * 16 + 1)}, 400, "prompt", ["characters", str(8192 * 16)]),
    (CHAT, {"messages": [{"role": "user", "content": "x" * (8192 * 16 + 1)}]}, 400, "messages", ["characters"]),
]


@pytest.mark.parametrize(("route", "body", "status", "param", "words"), BAD_REQUESTS,
                         ids=[f"{r.rsplit('/', 1)[-1]}-{p}-{i}" for i, (r, _, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_request(served: Served, route: str, body: dict[str, Any], status: int, param: str,
                     words: list[str]) -> None:
    body = {"model": served.model, **body}  # model is required; a case may replace or remove it
    r = http(served.base, "POST", route, {k: v for k, v in body.items() if v is not None})
    assert r.status == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"], err
    assert err["param"] == param
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_accounting_counts_what_happened(served: Served) -> None:
    """A finished stream is ok (not cancelled), a 400 and a 404 are errors by code, in the real registry."""
    before = counts(served)
    client = served.client()
    chunks = list(client.completions.create(model=served.model, prompt="Hello", max_tokens=3, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    client.completions.create(model=served.model, prompt="Hello", max_tokens=2, temperature=0,
                              extra_body={"ignore_eos": True})
    assert http(served.base, "POST", CHAT, {"messages": USER_MSG, "top_k": 2**31}).status == 400
    assert http(served.base, "POST", CHAT, {"messages": USER_MSG, "model": "nope"}).status == 404
    assert http(served.base, "POST", CHAT, None, raw=b"[" * 100_000).status == 400
    want = {"ok/length": 2, "error/error": 3, "error:invalid_argument": 2, "error:not_found": 1}
    assert eventually(lambda: delta(before, counts(served)) == want), delta(before, counts(served))
    assert counts(served)["inflight"] == 0


def test_unknown_model_names_both(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as ei:
        served.client().chat.completions.create(model="nope", messages=USER_MSG)  # type: ignore[arg-type]
    err = ei.value.body
    assert isinstance(err, dict) and err["code"] == "model_not_found"
    assert "nope" in err["message"] and served.model in err["message"]


def test_oversize_prompt_names_token_counts(served: Served) -> None:
    prompt = "hello " * 9000
    n = len(served.engine.tokenizer.encode(prompt))
    r = http(served.base, "POST", COMPLETIONS, {"model": served.model, "prompt": prompt, "max_tokens": 1})
    assert r.status == 400
    err = r.json()["error"]
    assert err["param"] == "prompt" and str(n) in err["message"] and "8192" in err["message"]
    assert err["code"] == "context_length_exceeded"


def test_malformed_json_wrong_body_type_and_oversize_body(served: Served) -> None:
    r = http(served.base, "POST", CHAT, None, raw=b'{"messages": [')
    assert r.status == 400 and "JSON" in r.json()["error"]["message"]
    for raw in (b"[" * 200_000, b'{"a":' * 100_000, b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
                b'{"prompt": "\xff\xfe"}', b"\xff\xfe{}"):
        r = http(served.base, "POST", COMPLETIONS, None, raw=raw)
        assert r.status == 400, (raw[:40], r.text)
        assert r.json()["error"]["code"] == "invalid_json"
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

    before = counts(served)
    assert asyncio.run(read_a_few_then_hang_up()) == 4
    assert served.wait_idle() == (0, 0, served.free_blocks)
    assert eventually(lambda: delta(before, counts(served)) == {"cancelled/cancelled": 1}), \
        delta(before, counts(served))


def test_disconnect_while_waiting_non_stream_aborts(served: Served) -> None:
    body = {"model": served.model, "prompt": "Write a long essay.", "max_tokens": 4000, "ignore_eos": True}

    async def give_up_after_a_second() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            await s.post(f"{served.base}{COMPLETIONS}", json=body)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(give_up_after_a_second())
    assert served.wait_idle() == (0, 0, served.free_blocks)
