"""OpenAI's error contract as the official ``openai`` client sees it: the exception's class (HTTP status),
``code`` and ``param`` for a prompt past the context, a value out of OpenAI's range, a missing required
field, a field of the wrong type, an unknown model and an unsupported parameter; ``tools`` with
``tool_choice: "none"`` served with the tools ignored."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from aiohttp.test_utils import TestServer

from services.router.openai_http import make_app
from tests.router.harness import FakeBackend, fake_pipeline

MAX_MODEL_LEN = 64
USER_MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture()
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    server = TestServer(make_app(fake_pipeline(FakeBackend("ok!"), max_model_len=MAX_MODEL_LEN)), host="127.0.0.1")
    await server.start_server()
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        yield c
    finally:
        await c.close()
        await server.close()


async def _chat_error(client: openai.AsyncOpenAI, **kw: Any) -> openai.APIStatusError:
    kw.setdefault("model", "fake")
    kw.setdefault("messages", USER_MSG)
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(**kw)
    return info.value


def _assert(e: openai.APIStatusError, cls: type[openai.APIStatusError], code: str, param: str | None) -> None:
    assert isinstance(e, cls), (type(e), e)
    assert (e.code, e.param) == (code, param), e.body


async def test_chat_prompt_past_the_context(client: openai.AsyncOpenAI) -> None:
    e = await _chat_error(client, messages=[{"role": "user", "content": "word " * MAX_MODEL_LEN}])
    _assert(e, openai.BadRequestError, "context_length_exceeded", "messages")


async def test_prompt_plus_max_tokens_past_the_context(client: openai.AsyncOpenAI) -> None:
    e = await _chat_error(client, max_tokens=MAX_MODEL_LEN)
    _assert(e, openai.BadRequestError, "context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model="fake", prompt="x" * MAX_MODEL_LEN, max_tokens=4)
    _assert(info.value, openai.BadRequestError, "context_length_exceeded", "prompt")


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("temperature", 3), ("temperature", -0.1),
                                              ("top_p", 1.5), ("max_tokens", 0)])
async def test_value_out_of_range(client: openai.AsyncOpenAI, field: str, value: float) -> None:
    e = await _chat_error(client, **{field: value})
    _assert(e, openai.BadRequestError, "invalid_value", field)


async def test_temperature_two_is_accepted(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model="fake", messages=USER_MSG, temperature=2, max_tokens=3)
    assert r.choices[0].message.content == "ok!"


async def test_missing_model(client: openai.AsyncOpenAI) -> None:
    # The client itself insists on model; NOT_GIVEN passes that check and leaves it out of the body.
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(messages=USER_MSG, model=openai.NOT_GIVEN)  # type: ignore[arg-type]
    _assert(info.value, openai.BadRequestError, "missing_required_parameter", "model")
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(prompt="hi", model=openai.NOT_GIVEN)  # type: ignore[arg-type]
    _assert(info.value, openai.BadRequestError, "missing_required_parameter", "model")


async def test_missing_messages_and_wrong_types(client: openai.AsyncOpenAI) -> None:
    e = await _chat_error(client, messages=openai.NOT_GIVEN)
    _assert(e, openai.BadRequestError, "missing_required_parameter", "messages")
    e = await _chat_error(client, extra_body={"temperature": "hot"})
    _assert(e, openai.BadRequestError, "invalid_type", "temperature")
    e = await _chat_error(client, extra_body={"max_tokens": "ten"})
    _assert(e, openai.BadRequestError, "invalid_type", "max_tokens")


async def test_unknown_model(client: openai.AsyncOpenAI) -> None:
    e = await _chat_error(client, model="gpt-9")
    _assert(e, openai.NotFoundError, "model_not_found", "model")


@pytest.mark.parametrize(("field", "value"), [("frequency_penalty", 1.0), ("n", 2), ("logit_bias", {"1": 5}),
                                              ("tool_choice", "auto")])
async def test_unsupported_parameter(client: openai.AsyncOpenAI, field: str, value: Any) -> None:
    e = await _chat_error(client, **{field: value})
    _assert(e, openai.BadRequestError, "unsupported_parameter", field)


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}]


async def test_tools_with_tool_choice_none_are_ignored(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model="fake", messages=USER_MSG, tools=TOOLS,  # type: ignore[arg-type]
                                             tool_choice="none", max_tokens=3)
    assert r.choices[0].message.content == "ok!" and not r.choices[0].message.tool_calls
    for choice in ("auto", "required", None):
        kw = {"tool_choice": choice} if choice else {}
        e = await _chat_error(client, tools=TOOLS, **kw)
        _assert(e, openai.BadRequestError, "unsupported_parameter", "tool_choice" if choice else "tools")
