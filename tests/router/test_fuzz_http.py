"""Fuzzing the OpenAI HTTP API (hypothesis): generated bodies for both generation routes against the
real aiohttp app over an in-process fake backend.

Stated size: 300 examples per route (FUZZ_EXAMPLES), plus 150 raw byte bodies, deadline disabled.
Every answer must be 200/400/404/413/422, or one of the designed outcomes of load (429 and 503 with
Retry-After, 504 deadline_exceeded when a short X-Request-Timeout runs out on a busy host), a JSON error
body whenever it is not 200, a completed generation whenever it is 200 (never a 500, never an empty
success), within CALL_TIMEOUT_S (never a hang); afterwards the fake backend holds no open request and the router no in-flight slot (no leak).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.router.metering import RequestMeter
from services.router.openai_http import TIMEOUT_HEADER, make_app
from tests.router.harness import CALL_TIMEOUT_S, FUZZ, FakeBackend, LoopThread, fake_pipeline, sse_events

ALLOWED = {200, 400, 404, 413, 422, 429, 503, 504}
RETRY_AFTER = {429, 503}
"""Statuses that tell the client when to come back (Retry-After, whole seconds)."""
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"



@dataclass
class Target:
    loop: LoopThread
    base: str
    backend: FakeBackend
    meter: RequestMeter
    session: aiohttp.ClientSession
    statuses: Counter[int] = field(default_factory=Counter)

    def call(self, path: str, data: bytes, headers: dict[str, str]) -> tuple[int, str, str, str | None]:
        """(status, Content-Type, body, Retry-After)."""
        async def go() -> tuple[int, str, str, str | None]:
            async with self.session.post(f"{self.base}{path}", data=data, headers=headers) as r:
                return r.status, r.headers.get("Content-Type", ""), await r.text(), r.headers.get("Retry-After")
        return self.loop.run(go(), timeout=CALL_TIMEOUT_S + 5)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    loop = LoopThread()
    backend = FakeBackend("fuzz!")
    meter = RequestMeter(None, "fake", max_inflight=64)
    server = loop.serve(lambda: make_app(fake_pipeline(backend, max_model_len=256), meter=meter,
                                         request_timeout_s=10.0))

    async def open_session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))

    session = loop.run(open_session())
    target = Target(loop, f"http://127.0.0.1:{server.port}", backend, meter, session)
    try:
        yield target
        deadline = time.monotonic() + 5
        while (backend.open or meter.inflight) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not backend.open, f"requests left open in the backend: {backend.open}"
        assert meter.inflight == 0, f"{meter.inflight} in-flight slots leaked"
        # The run is meaningful: bodies reached generation as well as the validators.
        assert target.statuses[200] >= 20 and target.statuses[400] >= 20, target.statuses
        assert len(backend.seen) == target.statuses[200]
    finally:
        loop.run(session.close())
        loop.close(server)


# --- strategies: plausible values mixed with arbitrary JSON of every type ---

text = st.text(st.one_of(st.characters(), st.characters(codec=None, categories=["Cs"])), max_size=40)
huge_ints = st.one_of(st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
                      st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**63, -(2**63) - 1, 2**64, 10**30]))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, st.floats(allow_nan=True, allow_infinity=True), text)
any_json = st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(text, kids, max_size=4)), max_leaves=12)


def fuzzed(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(plausible, plausible, any_json)


token_ids = st.lists(huge_ints | st.integers(0, 300), max_size=8)
COMMON = {
    "model": fuzzed(st.sampled_from(["fake", "gpt-4", ""])),
    "max_tokens": fuzzed(st.integers(-2, 300) | huge_ints),
    "temperature": fuzzed(st.floats(-1, 3)),
    "top_p": fuzzed(st.floats(-0.5, 1.5)),
    "top_k": fuzzed(st.integers(-3, 100) | huge_ints),
    "seed": fuzzed(huge_ints),
    "stop": fuzzed(st.one_of(text, st.lists(text, max_size=20))),
    "stop_token_ids": fuzzed(token_ids),
    "stream": fuzzed(st.booleans()),
    "stream_options": fuzzed(st.fixed_dictionaries({}, optional={"include_usage": fuzzed(st.booleans())})),
    "n": fuzzed(st.integers(-1, 3)),
    "ignore_eos": fuzzed(st.booleans()),
    "user": fuzzed(text),
    "presence_penalty": fuzzed(st.floats(-2, 2)),
    "logit_bias": fuzzed(st.dictionaries(text, st.integers(-100, 100), max_size=2)),
    "response_format": fuzzed(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
}
message = st.fixed_dictionaries({}, optional={
    "role": fuzzed(st.sampled_from(["system", "user", "assistant", "tool", "wizard"])),
    "content": fuzzed(st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}),
                                              max_size=3))),
    "name": fuzzed(text)})
fuzzed_completion = st.fixed_dictionaries({}, optional={
    **COMMON,
    "prompt": fuzzed(st.one_of(text, token_ids, st.lists(text, max_size=3), st.lists(token_ids, max_size=2))),
    "logprobs": fuzzed(st.integers(-1, 7)),
    "echo": fuzzed(st.booleans()),
    "best_of": fuzzed(st.integers(0, 3)),
})
fuzzed_chat = st.fixed_dictionaries({}, optional={
    **COMMON,
    "messages": fuzzed(st.lists(message, max_size=4)),
    "max_completion_tokens": fuzzed(st.integers(-2, 300) | huge_ints),
    "logprobs": fuzzed(st.booleans()),
    "top_logprobs": fuzzed(st.integers(-1, 25)),
    "tools": fuzzed(st.lists(any_json, max_size=2)),
})
# Valid bodies (so generation is reached), the same with one field replaced by anything, and bodies
# fuzzed field by field: a third each.
clean_text = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)
VALID = {
    "max_tokens": st.integers(1, 20), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50), "seed": st.integers(-(2**63), 2**63 - 1), "stream": st.booleans(),
    "ignore_eos": st.booleans(), "user": clean_text, "stop": st.lists(clean_text, max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 256), max_size=3), "n": st.just(1),
}
valid_completion = st.fixed_dictionaries({"model": st.just("fake"), "prompt": clean_text | st.lists(
    st.integers(0, 255), min_size=1, max_size=30)}, optional=VALID)
valid_chat = st.fixed_dictionaries({"model": st.just("fake"), "messages": st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant"]), "content": clean_text}), min_size=1, max_size=2)},
    optional=VALID)


def one_field_replaced(valid: st.SearchStrategy[dict[str, Any]], names: list[str]) -> st.SearchStrategy[Any]:
    return st.tuples(valid, st.sampled_from(names), any_json).map(lambda t: {**t[0], t[1]: t[2]})


completion_bodies = st.one_of(valid_completion, one_field_replaced(valid_completion, [*COMMON, "prompt"]),
                              fuzzed_completion)
chat_bodies = st.one_of(valid_chat, one_field_replaced(valid_chat, [*COMMON, "messages"]), fuzzed_chat)
timeouts = st.one_of(st.none(), st.sampled_from(["5", "0.5", "0", "-1", "nan", "abc", "1e400"]))


def encode(body: Any) -> bytes:
    """JSON as a client would send it (lone surrogates as \\u escapes, NaN/Infinity as Python writes them)."""
    return json.dumps(body).encode()


def check_answer(status: int, content_type: str, text: str, retry_after: str | None = None) -> None:
    assert status in ALLOWED, (status, text[:300])
    if status != 200:
        err = json.loads(text)["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert set(err) == {"message", "type", "param", "code"}
        if status == 504:
            assert (err["code"], err["type"]) == ("deadline_exceeded", "timeout_error"), err
        if status in RETRY_AFTER:
            assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, (status, err)
        return
    if content_type.startswith("text/event-stream"):
        events = sse_events(text)
        assert events and events[-1] == "[DONE]", events[-3:]  # the fake backend never fails
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])
                    if c.get("finish_reason")]
        assert finishes and finishes[-1] in ("stop", "length")
        return
    reply = json.loads(text)
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")
    assert reply["usage"]["completion_tokens"] >= 1


def exchange(target: Target, path: str, data: bytes, timeout: str | None) -> None:
    headers = {"Content-Type": "application/json"}
    if timeout is not None:
        headers[TIMEOUT_HEADER] = timeout
    t0 = time.monotonic()
    status, content_type, text, retry_after = target.call(path, data, headers)
    target.statuses[status] += 1
    assert time.monotonic() - t0 < CALL_TIMEOUT_S
    check_answer(status, content_type, text, retry_after)


@FUZZ
@given(body=completion_bodies, timeout=timeouts)
def test_fuzz_completions(target: Target, body: dict[str, Any], timeout: str | None) -> None:
    exchange(target, COMPLETIONS, encode(body), timeout)


@FUZZ
@given(body=chat_bodies, timeout=timeouts)
def test_fuzz_chat_completions(target: Target, body: dict[str, Any], timeout: str | None) -> None:
    exchange(target, CHAT, encode(body), timeout)


raw_bodies = st.one_of(
    st.binary(max_size=200),
    any_json.map(encode),
    st.integers(1, 5000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 200_000).map(lambda n: b'{"messages":' + b"[" * n),
    st.integers(4000, 6000).map(lambda n: b'{"prompt": "x", "max_tokens": ' + b"9" * n + b"}"),
)


@settings(FUZZ, max_examples=150)
@given(data=raw_bodies, chat=st.booleans())
def test_fuzz_raw_bytes(target: Target, data: bytes, chat: bool) -> None:
    exchange(target, CHAT if chat else COMPLETIONS, data, None)

