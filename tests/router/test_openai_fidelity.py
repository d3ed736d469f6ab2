"""OpenAI fidelity measured with the official client's own types (sync and async): top logprobs, usage,
finish reasons, /v1/models/{id}, and the documented 400s for parameters pdserve does not support."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import openai
import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.router.openai_http import make_app
from services.router.openai_schema import UNSUPPORTED_PARAMS
from services.router.pipeline import TextPipeline
from services.text.sampling_params import MAX_TOP_LOGPROBS
from tests.router.harness import LoopThread
from tests.router.local_backend import LocalEngineBackend

MSGS = [{"role": "user", "content": "Name three colours."}]
FINISH = {"stop", "length"}
# A long shared prefix: the second request over it hits the engine's prefix cache (16-token blocks).
PREFIX = "You are a careful assistant. " * 12


class Served:
    def __init__(self, engine: AsyncEngine, pipeline: TextPipeline, base: str) -> None:
        self.engine, self.pipeline, self.base = engine, pipeline, base

    @property
    def model(self) -> str:
        return self.pipeline.model_name()

    def sync(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=120)

    def aio(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    engine = AsyncEngine(EngineConfig(dtype="float32", kv_cache_bytes=64 << 20))
    pipeline = TextPipeline(engine.tokenizer, LocalEngineBackend(engine), engine.engine.max_model_len)
    loop = LoopThread()
    server = loop.serve(lambda: make_app(pipeline))
    try:
        yield Served(engine, pipeline, f"http://127.0.0.1:{server.port}")
    finally:
        loop.close(server)
        engine.shutdown()


def _check_chat_logprobs(content: list, k: int, greedy: bool) -> None:
    assert content, "no logprobs entries"
    for pos in content:
        alts = pos.top_logprobs
        assert len(alts) == k
        values = [a.logprob for a in alts]
        assert values == sorted(values, reverse=True)  # most likely first
        assert all(v <= 0 and math.isfinite(v) for v in values)
        assert all(a.bytes == list(a.token.encode()) for a in alts)
        assert pos.logprob <= values[0] + 1e-6  # nothing beats the most likely alternative
        if greedy:  # the chosen token is the argmax: it leads the list with the same logprob
            assert alts[0].token == pos.token and abs(alts[0].logprob - pos.logprob) < 1e-5
        elif pos.logprob >= values[-1] - 1e-6:
            assert pos.token in {a.token for a in alts}


@pytest.mark.parametrize("k", [1, 5, MAX_TOP_LOGPROBS])
def test_chat_top_logprobs_sync(served: Served, k: int) -> None:
    r = served.sync().chat.completions.create(model=served.model, messages=MSGS, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=k)
    choice = r.choices[0]
    assert choice.finish_reason in FINISH
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _check_chat_logprobs(choice.logprobs.content, k, greedy=True)
    assert len(choice.logprobs.content) == r.usage.completion_tokens


def test_chat_logprobs_without_top_lists_no_alternatives(served: Served) -> None:
    r = served.sync().chat.completions.create(model=served.model, messages=MSGS, max_tokens=4, temperature=0,
                                              logprobs=True)
    content = r.choices[0].logprobs.content
    assert content and all(p.top_logprobs == [] for p in content)


def test_chat_top_logprobs_async_stream_sampled(served: Served) -> None:
    async def run() -> tuple[list, int, str | None]:
        client = served.aio()
        entries: list = []
        usage, reason = 0, None
        stream = await client.chat.completions.create(
            model=served.model, messages=MSGS, max_tokens=8, temperature=0.9, seed=3, logprobs=True,
            top_logprobs=4, stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.logprobs is not None and c.logprobs.content:
                    entries += c.logprobs.content
                reason = c.finish_reason or reason
        await client.close()
        return entries, usage, reason

    entries, usage, reason = asyncio.run(run())
    assert reason in FINISH
    assert len(entries) == usage > 0
    _check_chat_logprobs(entries, 4, greedy=False)


def test_completions_logprobs_n_sync_and_async(served: Served) -> None:
    k = 3
    sync = served.sync().completions.create(model=served.model, prompt="The sky is", max_tokens=5,
                                            temperature=0, logprobs=k)

    async def run():
        client = served.aio()
        try:
            return await client.completions.create(model=served.model, prompt="The sky is", max_tokens=5,
                                                   temperature=0, logprobs=k)
        finally:
            await client.close()

    for r in (sync, asyncio.run(run())):
        lp = r.choices[0].logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
        assert "".join(lp.tokens) == r.choices[0].text
        for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            # The sampled token is always listed (OpenAI's legacy rule): k or k + 1 entries.
            assert tok in top and top[tok] == chosen
            assert k <= len(top) <= k + 1
            values = list(top.values())[:k]
            assert values == sorted(values, reverse=True)
            assert chosen == max(top.values())  # greedy: the sampled token is the most likely
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert sync.choices[0].text == r.choices[0].text  # greedy: the same text both ways


@pytest.mark.parametrize(("route", "extra", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs=true
    ("completions", {"logprobs": MAX_TOP_LOGPROBS + 1}, "logprobs"),
])
def test_logprob_limits_answer_400_with_param(served: Served, route: str, extra: dict, param: str) -> None:
    client = served.sync()
    with pytest.raises(openai.BadRequestError) as e:
        if route == "chat":
            client.chat.completions.create(model=served.model, messages=MSGS, max_tokens=2, extra_body=extra)
        else:
            client.completions.create(model=served.model, prompt="hi", max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_PARAMS))
def test_each_unsupported_parameter_is_a_clean_400(served: Served, name: str) -> None:
    bad = {"n": 2, "best_of": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "logit_bias": {"1": 5},
           "echo": True, "suffix": "end", "tools": [{"type": "function", "function": {"name": "f"}}],
           "tool_choice": "auto", "functions": [{"name": "f"}], "function_call": "auto",
           "response_format": {"type": "json_object"}, "modalities": ["text", "audio"],
           "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"}}
    with pytest.raises(openai.BadRequestError) as e:
        served.sync().chat.completions.create(model=served.model, messages=MSGS, max_tokens=2,
                                              extra_body={name: bad[name]})
    assert e.value.param == name and e.value.code == "unsupported_parameter"
    assert UNSUPPORTED_PARAMS[name][1] in e.value.message  # says why


def test_usage_counts_cached_prefix_once(served: Served) -> None:
    client = served.sync()
    tok = served.pipeline
    prompts = [PREFIX + "Say one.", PREFIX + "Say two."]
    results = [client.completions.create(model=served.model, prompt=p, max_tokens=3, temperature=0)
               for p in prompts]
    for p, r in zip(prompts, results, strict=True):
        u = r.usage
        assert u.prompt_tokens == len(tok.encode_text(p))
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert r.choices[0].finish_reason in FINISH
    first, second = (r.usage.prompt_tokens_details.cached_tokens for r in results)
    # The shared prefix's full blocks come from the cache the second time; never more than the prompt
    # minus the token that must be computed, and a whole number of 16-token blocks.
    shared = len(tok.encode_text(PREFIX))
    assert second >= (shared // 16 - 1) * 16 > 0
    assert second <= results[1].usage.prompt_tokens - 1 and second % 16 == 0
    assert first <= second


def test_models_retrieve_sync_and_async(served: Served) -> None:
    card = served.sync().models.retrieve(served.model)
    assert card.id == served.model and card.object == "model" and card.owned_by == "pdserve"
    with pytest.raises(openai.NotFoundError) as e:
        served.sync().models.retrieve("no-such-model")
    assert e.value.code == "model_not_found"

    async def run():
        client = served.aio()
        try:
            return [m.id async for m in client.models.list()], await client.models.retrieve(served.model)
        finally:
            await client.close()

    ids, acard = asyncio.run(run())
    assert ids == [served.model] and acard.id == served.model


def test_api_doc_lists_exactly_the_refused_parameters() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "API.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].strip("`") in UNSUPPORTED_PARAMS:
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    assert rows == UNSUPPORTED_PARAMS


def test_refusals_reach_the_async_client_too(served: Served) -> None:
    async def run() -> list[tuple[int, str | None, str | None]]:
        client = served.aio()
        out = []
        try:
            for body in ({"n": 3}, {"logit_bias": {"5": 1.0}}, {"logprobs": True, "top_logprobs": 21}):
                try:
                    await client.chat.completions.create(model=served.model, messages=MSGS, max_tokens=2,
                                                         extra_body=body)
                except openai.BadRequestError as e:
                    out.append((e.status_code, e.param, e.code))
        finally:
            await client.close()
        return out

    assert asyncio.run(run()) == [(400, "n", "unsupported_parameter"), (400, "logit_bias", "unsupported_parameter"),
                                  (400, "top_logprobs", "invalid_value")]
