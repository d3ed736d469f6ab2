"""TextPipeline over a scripted backend and the byte-level tokenizer (id b < 256 is byte b, 256 is EOS)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from services.router.pipeline import MAX_CHARS_PER_TOKEN, BackendError, TextDelta, TextPipeline, TokenEvent
from services.text.sampling_params import InvalidRequestError, SamplingParams
from services.text.tokenizer import Tokenizer

EOS = 256


class ScriptedBackend:
    """Yields the scripted events one by one; records aborts and how far the consumer read."""

    def __init__(self, events: list[TokenEvent], *, error: BackendError | None = None, hang: bool = False) -> None:
        self.events = events
        self.error = error
        self.hang = hang
        self.aborted: list[str] = []
        self.yielded = 0
        self.closed = False
        self.called = False
        self.deadline: float | None = None

    def model_name(self) -> str:
        return "scripted"

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None) -> AsyncIterator[TokenEvent]:
        self.called = True
        self.deadline = deadline
        if self.error is not None:
            raise self.error
        try:
            for ev in self.events:
                await asyncio.sleep(0)
                self.yielded += 1
                yield ev
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.closed = True

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def byte_events(text: str, finish: str | None = "length", *, eos: bool = False, prompt_tokens: int = 3
                ) -> list[TokenEvent]:
    ids = list(text.encode())
    evs = [TokenEvent([t], [-0.5], prompt_tokens=prompt_tokens) for t in ids]
    if eos:
        evs.append(TokenEvent([EOS], [-0.1], prompt_tokens=prompt_tokens))
    if finish is not None:
        evs[-1].finish_reason = finish
    return evs


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.byte_level(EOS)


def make(tokenizer: Tokenizer, backend: ScriptedBackend, max_model_len: int = 64) -> TextPipeline:
    return TextPipeline(tokenizer, backend, max_model_len)


async def collect(p: TextPipeline, params: SamplingParams | None = None, prompt: str = "abc",
                  deadline: float | None = None) -> list[TextDelta]:
    ids = p.encode_text(prompt)
    sp = p.check(ids, params or SamplingParams(), max_tokens=None)
    return [d async for d in p.generate("r1", ids, sp, deadline=deadline)]


async def test_streams_text_and_usage(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("hello world"))
    out = await collect(make(tokenizer, be))
    assert "".join(d.text for d in out) == "hello world"
    assert [d.finish_reason for d in out[:-1]] == [None] * (len(out) - 1)
    last = out[-1]
    assert last.finish_reason == "length"
    assert last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == (3, 11, 14)
    assert sum(len(d.token_ids) for d in out) == 11
    assert all(lp == -0.5 for d in out for lp in d.logprobs)
    assert be.aborted == []


async def test_eos_counts_as_a_token_but_not_as_text(tokenizer: Tokenizer) -> None:
    out = await collect(make(tokenizer, ScriptedBackend(byte_events("hi", "stop", eos=True))))
    assert "".join(d.text for d in out) == "hi"
    assert out[-1].finish_reason == "stop"
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == 3


async def test_multibyte_character_split_across_tokens(tokenizer: Tokenizer) -> None:
    out = await collect(make(tokenizer, ScriptedBackend(byte_events("é!"))))
    assert out[0].text == ""  # half a character is held back
    assert "".join(d.text for d in out) == "é!"


async def test_stop_string_spanning_events_truncates_and_aborts(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("hello STOP and more text", None))
    out = await collect(make(tokenizer, be), SamplingParams(stop=["STOP"]))
    assert "".join(d.text for d in out) == "hello "
    assert out[-1].finish_reason == "stop"
    assert be.aborted == ["r1"]
    assert be.yielded == len("hello STOP")  # nothing read past the hit
    assert be.closed
    assert out[-1].usage is not None and out[-1].usage.completion_tokens == len("hello STOP")


async def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    out = await collect(make(tokenizer, ScriptedBackend(byte_events("one two three"))),
                        SamplingParams(stop=["three", "two"]))
    assert "".join(d.text for d in out) == "one "


async def test_partial_stop_string_released_at_the_end(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("xab"))
    out = await collect(make(tokenizer, be), SamplingParams(stop=["abc"]))
    assert "".join(d.text for d in out) == "xab"
    assert out[-1].finish_reason == "length"
    assert be.aborted == []


async def test_closing_the_stream_early_aborts(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("abcdef", None), hang=True)
    p = make(tokenizer, be)
    ids = p.encode_text("x")
    gen = p.generate("r-close", ids, p.check(ids, SamplingParams(), max_tokens=8))
    assert (await anext(gen)).text == "a"
    await gen.aclose()
    assert be.aborted == ["r-close"]
    assert be.closed


async def test_cancelling_the_consumer_aborts(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("ab", None), hang=True)
    p = make(tokenizer, be)
    ids = p.encode_text("x")
    seen: list[str] = []
    two_seen = asyncio.Event()

    async def consume() -> None:
        async for d in p.generate("r-cancel", ids, p.check(ids, SamplingParams(), max_tokens=8)):
            seen.append(d.text)
            if len(seen) == 2:
                two_seen.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(two_seen.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert be.aborted == ["r-cancel"]


async def test_backend_error_propagates(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend([], error=BackendError("unavailable", "no decode instance"))
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, be))
    assert ei.value.code == "unavailable"


async def test_stream_without_finish_reason_is_an_internal_error(tokenizer: Tokenizer) -> None:
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, ScriptedBackend(byte_events("ab", None))))
    assert ei.value.code == "internal"


def test_backend_error_code_is_checked() -> None:
    with pytest.raises(ValueError):
        BackendError("deadline", "x")
    e = BackendError("invalid_argument", "bad", "top_k")  # positional param stays
    assert (e.code, e.param, e.retry_after_s, e.retryable) == ("invalid_argument", "top_k", None, False)
    e = BackendError("resource_exhausted", "full", retry_after_s=2.5)
    assert (e.retry_after_s, e.retryable) == (2.5, True)


# --- honest endings: a client only ever sees stop/length; everything else is a BackendError ---


async def test_aborted_backend_stream_is_an_unavailable_error(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("ab", "abort"))
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, be))
    assert ei.value.code == "unavailable" and ei.value.retry_after_s is not None
    assert be.aborted == ["r1"]


async def test_aborted_after_the_deadline_is_deadline_exceeded(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend([TokenEvent([97], [-0.1])])

    async def slow_abort() -> AsyncIterator[TokenEvent]:
        yield TokenEvent([97], [-0.1])
        time.sleep(0.2)  # noqa: ASYNC251 - blocks on purpose: the abort lands past the deadline, before its timer
        yield TokenEvent([98], [-0.1], finish_reason="abort")

    be.generate = lambda *a, **k: slow_abort()  # type: ignore[method-assign]
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, be), deadline=time.time() + 0.1)
    assert ei.value.code == "deadline_exceeded" and "gave it up" in ei.value.message


async def test_unknown_finish_reason_and_tokenless_finish_are_internal(tokenizer: Tokenizer) -> None:
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, ScriptedBackend(byte_events("ab", "eos"))))
    assert ei.value.code == "internal" and "eos" in ei.value.message
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, ScriptedBackend([TokenEvent([], [], finish_reason="stop")])))
    assert ei.value.code == "internal" and "without generating a token" in ei.value.message


async def test_deadline_passing_mid_generation_aborts(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("ab", None), hang=True)
    p = make(tokenizer, be)
    seen: list[str] = []
    deadline = time.time() + 0.3
    with pytest.raises(BackendError) as ei:
        ids = p.encode_text("x")
        async for d in p.generate("r-dl", ids, p.check(ids, SamplingParams(), max_tokens=8), deadline=deadline):
            seen.append(d.text)
    assert ei.value.code == "deadline_exceeded"
    assert seen == ["a", "b"] and time.time() >= deadline
    assert be.deadline == deadline  # handed down to the backend as given (Unix seconds)
    assert be.aborted == ["r-dl"] and be.closed


async def test_deadline_already_past_never_reaches_the_backend(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("ab"))
    with pytest.raises(BackendError) as ei:
        await collect(make(tokenizer, be), deadline=time.time() - 1)
    assert ei.value.code == "deadline_exceeded" and not be.called


async def test_deadline_not_reached_changes_nothing(tokenizer: Tokenizer) -> None:
    be = ScriptedBackend(byte_events("hello"))
    out = await collect(make(tokenizer, be), deadline=time.time() + 60)
    assert "".join(d.text for d in out) == "hello" and out[-1].finish_reason == "length"
    assert be.aborted == []


def test_check_prompt_limits(tokenizer: Tokenizer) -> None:
    p = make(tokenizer, ScriptedBackend([]), max_model_len=16)
    with pytest.raises(InvalidRequestError) as ei:
        p.check([], SamplingParams(), max_tokens=4, prompt_field="messages")
    assert ei.value.field == "messages"
    with pytest.raises(InvalidRequestError) as ei:
        p.check(list(range(16)), SamplingParams(), max_tokens=None)
    assert ei.value.field == "prompt" and "16 tokens" in str(ei.value)
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as ei:
        p.check(list(range(10)), SamplingParams(), max_tokens=7)
    assert ei.value.field == "max_tokens" and "17" in str(ei.value) and "16" in str(ei.value)
    assert ei.value.code == "context_length_exceeded"
    assert p.check(list(range(10)), SamplingParams(), max_tokens=None).max_tokens == 6
    assert p.check(list(range(10)), SamplingParams(), max_tokens=6).max_tokens == 6
    with pytest.raises(InvalidRequestError) as ei:
        p.check([1], SamplingParams(temperature=-1.0), max_tokens=2)
    assert ei.value.field == "temperature"
    vocab = tokenizer.vocab_size
    with pytest.raises(InvalidRequestError) as ei:
        p.check([1, vocab], SamplingParams(), max_tokens=2, prompt_field="token_ids")
    assert ei.value.field == "token_ids" and "vocabulary" in str(ei.value)
    with pytest.raises(InvalidRequestError) as ei:
        p.check([1, -1], SamplingParams(), max_tokens=2)
    assert ei.value.field == "prompt"
    with pytest.raises(InvalidRequestError) as ei:
        p.check([1], SamplingParams(stop_token_ids=[vocab + 5]), max_tokens=2)
    assert ei.value.field == "stop_token_ids"
    assert p.check([1, vocab - 1], SamplingParams(stop_token_ids=[vocab - 1]), max_tokens=2).max_tokens == 2


def test_prompt_characters_capped_before_tokenizing(tokenizer: Tokenizer) -> None:
    p = make(tokenizer, ScriptedBackend([]), max_model_len=16)
    limit = 16 * MAX_CHARS_PER_TOKEN
    assert p.max_prompt_chars == limit
    assert len(p.encode_text("x" * limit)) == limit  # at the cap: tokenized (check() refuses it by tokens)
    with pytest.raises(InvalidRequestError) as ei:
        p.encode_text("x" * (limit + 1))
    assert ei.value.field == "prompt" and str(limit) in str(ei.value)
    with pytest.raises(InvalidRequestError) as ei:
        p.encode_text("x" * (limit + 1), "text")
    assert ei.value.field == "text"
    with pytest.raises(InvalidRequestError) as ei:
        p.encode_chat([{"role": "user", "content": "y" * limit}])
    assert ei.value.field == "messages" and "characters" in str(ei.value)


def test_prompt_encoding(tokenizer: Tokenizer) -> None:
    p = make(tokenizer, ScriptedBackend([]))
    assert p.encode_text("hi") == [104, 105]
    ids = p.encode_chat([{"role": "user", "content": "hi"}])
    rendered = tokenizer.decode(ids)
    assert rendered.startswith("<|im_start|>user\nhi") and rendered.endswith("<|im_start|>assistant\n")
    with pytest.raises(InvalidRequestError) as ei:
        p.encode_chat([])
    assert ei.value.field == "messages"
