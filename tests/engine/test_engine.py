"""LLMEngine end to end on the embedded GGUF (fp32): scheduler + model runner + paged KV together.

Batching, chunking, prefix hits and preemption must not change greedy tokens; blocks must all come
back however a request ends; bad requests and bad models fail with errors naming the field or file
while the engine keeps serving. The model is loaded once per session (conftest ``our_gguf_model``);
each engine here only allocates its own KV pool.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.sequence import FinishReason
from services.text.model.errors import ModelLoadError
from services.text.sampling_params import InvalidRequestError, SamplingParams

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
        "combined movable metal type, oil-based ink and a wooden screw press into a system that could "
        "produce books quickly and cheaply. Within fifty years presses were running in more than two "
        "hundred European cities, and the number of books in circulation grew from thousands to "
        "millions. Scholars could compare identical copies of a text, errors could be corrected in later "
        "editions, and new ideas spread faster than any authority could suppress them. Historians often "
        "link the press to the Reformation, the scientific revolution and the rise of literacy, although "
        "each of these had other causes as well. In East Asia, movable type had been invented centuries "
        "earlier, but the large number of characters made it less practical than woodblock printing.")
CHAT_QUESTION = "What is the capital of France?"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def _engine(loaded: Any, **kw: Any) -> LLMEngine:
    cfg = dict(dtype="float32", num_kv_blocks=96, block_size=16)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), loaded=loaded)


def _params(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw})


def _run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams
         ) -> tuple[list[int], str, RequestOutput]:
    """Drive one request to completion: (tokens, text, last output)."""
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    text = ""
    last = None
    while engine.has_work():
        for o in engine.step():
            assert o.request_id == request_id
            tokens += o.new_token_ids
            text += o.new_text
            last = o
    assert last is not None and last.finished
    return tokens, text, last


@pytest.fixture(scope="module")
def tok(our_gguf_model: Any) -> Any:
    return our_gguf_model.tokenizer


@pytest.fixture(scope="module")
def text_ids(tok: Any) -> list[int]:
    ids = tok.encode(TEXT)
    assert len(ids) > 150
    return ids


@pytest.fixture(scope="module")
def chat_ids(tok: Any) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}]),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def solo(our_gguf_model: Any) -> LLMEngine:
    """One request at a time, no prefix caching: the reference every batched run must equal."""
    return _engine(our_gguf_model, enable_prefix_caching=False)


def _alone(solo: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [solo.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]


@pytest.fixture(scope="module")
def short_expected(solo: LLMEngine, text_ids: list[int]) -> list[int]:
    """Greedy tokens of text_ids[:10] alone: what a healthy engine answers after a rejected request."""
    return _alone(solo, [text_ids[:10]], [GREEDY])[0]


# --- batching -------------------------------------------------------------------------------------


def test_16_mixed_length_requests_batched_equal_alone(our_gguf_model: Any, solo: LLMEngine,
                                                      text_ids: list[int]) -> None:
    lengths = [3, 150, 9, 64, 17, 100, 1, 33, 48, 5, 120, 16, 80, 27, 140, 11]
    prompts = [text_ids[i % 7:i % 7 + n] for i, n in enumerate(lengths)]  # shared prefixes too
    params = [_params(max_tokens=4 + (i * 5) % 21) for i in range(16)]
    # A 160-token budget with 64-token chunks: prefills are split and share steps with decodes.
    engine = _engine(our_gguf_model, max_num_batched_tokens=160, max_prefill_chunk=64)
    start = engine.block_manager.num_free_blocks
    batched = engine.generate(prompts, params)
    assert batched == _alone(solo, prompts, params)
    assert all(0 < len(b) <= p.max_tokens for b, p in zip(batched, params, strict=True))
    assert engine.block_manager.num_free_blocks == start
    assert engine.block_manager.num_prefix_hit_tokens > 0  # the shared prefixes were reused


def test_seeded_sampling_same_alone_and_in_a_batch(our_gguf_model: Any, solo: LLMEngine,
                                                   text_ids: list[int]) -> None:
    seeded = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    prompt = text_ids[:20]
    alone = solo.generate([prompt], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5),
              SamplingParams(temperature=0.7, seed=8, max_tokens=16, ignore_eos=True)]
    engine = _engine(our_gguf_model)
    batched = engine.generate([text_ids[30:45], prompt, text_ids[60:100], text_ids[5:9]],
                              [others[0], seeded, *others[1:]])
    assert batched[1] == alone
    assert batched[3] != alone  # another seed is another stream


# --- block accounting -----------------------------------------------------------------------------


def test_blocks_return_after_finish_and_aborts(our_gguf_model: Any, solo: LLMEngine,
                                               text_ids: list[int]) -> None:
    engine = _engine(our_gguf_model, max_num_batched_tokens=32, max_prefill_chunk=16)
    start = engine.block_manager.num_free_blocks
    assert start == engine.runner.num_blocks

    # Finished normally.
    engine.generate([text_ids[:40]], _params(max_tokens=5))
    assert engine.block_manager.num_free_blocks == start

    # Aborted mid-prefill: 100-token prompt, 16-token chunks.
    seq = engine.add_request("mid-prefill", text_ids[:100], _params(max_tokens=50))
    engine.step()
    assert 0 < seq.num_computed_tokens < 100 and seq.num_output_tokens == 0
    assert engine.block_manager.num_free_blocks < start
    final = engine.abort("mid-prefill")
    assert final is not None and final.finished and final.finish_reason == FinishReason.ABORT
    assert engine.block_manager.num_free_blocks == start

    # Aborted mid-decode, next to a request that keeps running.
    engine.add_request("keep", text_ids[5:30], _params(max_tokens=12))
    seq = engine.add_request("mid-decode", text_ids[50:80], _params(max_tokens=50, ignore_eos=True))
    kept: list[int] = []
    while seq.num_output_tokens < 3:
        for o in engine.step():
            if o.request_id == "keep":
                kept += o.new_token_ids
    assert engine.abort("mid-decode") is not None
    assert engine.abort("mid-decode") is None  # already gone
    while engine.has_work():
        for o in engine.step():
            assert o.request_id == "keep"
            kept += o.new_token_ids
    assert kept == _alone(solo, [text_ids[5:30]], [_params(max_tokens=12)])[0]

    # Aborted while still waiting (never scheduled).
    engine.add_request("waiting", text_ids[:20], _params())
    assert engine.abort("waiting") is not None
    assert engine.block_manager.num_free_blocks == start
    assert not engine.requests and not engine.has_work()
    engine.scheduler.check_invariants()


def test_preemption_keeps_outputs_and_returns_blocks(our_gguf_model: Any, text_ids: list[int]) -> None:
    prompts = [text_ids[i * 10:i * 10 + 20 + 3 * i] for i in range(8)]
    params = _params(max_tokens=40, ignore_eos=True)
    roomy = _engine(our_gguf_model, num_kv_blocks=96)
    expected = roomy.generate(prompts, params)
    assert roomy.scheduler.num_preemptions == 0

    # 8 sequences of up to 81 tokens need up to 6 blocks each (48); the pool has 14.
    tight = _engine(our_gguf_model, num_kv_blocks=14)
    start = tight.block_manager.num_free_blocks
    got = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert all(len(g) == 40 for g in got)
    assert tight.block_manager.num_free_blocks == start == 14
    tight.scheduler.check_invariants()


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "prompt", "params"), [
    ("prompt", "empty", {}),
    ("prompt", "too-long", {}),
    ("prompt", "bad-token", {}),
    ("max_tokens", "ok", {"max_tokens": 0}),
    ("max_tokens", "ok", {"max_tokens": -3}),
    ("temperature", "ok", {"temperature": -0.5}),
    ("top_p", "ok", {"top_p": 0.0}),
    ("top_p", "ok", {"top_p": 1.5}),
    ("top_p", "ok", {"top_p": -0.1}),
])
def test_bad_request_names_the_field_and_engine_keeps_serving(
        our_gguf_model: Any, short_expected: list[int], text_ids: list[int], field: str, prompt: str,
        params: dict[str, Any]) -> None:
    engine = _engine(our_gguf_model, max_model_len=256)
    ids = {"empty": [], "too-long": text_ids[:100] * 3, "bad-token": [1, 2, engine.vocab_size],
           "ok": text_ids[:10]}[prompt]
    start = engine.block_manager.num_free_blocks
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", ids, SamplingParams(**params))
    assert err.value.field == field and str(err.value).startswith(f"{field}:")
    assert not engine.requests and not engine.has_work()
    assert engine.block_manager.num_free_blocks == start
    # The same id is free again, and the engine serves a good request correctly.
    tokens, _, last = _run(engine, "bad", text_ids[:10], GREEDY)
    assert tokens == short_expected
    assert last.finish_reason is not None


def test_prompt_longer_than_the_model_context(our_gguf_model: Any) -> None:
    engine = _engine(our_gguf_model)
    assert engine.max_model_len == our_gguf_model.max_model_len == 8192
    with pytest.raises(InvalidRequestError, match=r"^prompt: 8192 tokens do not fit") as err:
        engine.add_request("long", [1] * 8192, GREEDY)
    assert err.value.field == "prompt"


def test_unknown_model_name() -> None:
    for spec in ("random:no-such-shape", "no-such-model-name"):
        with pytest.raises(ModelLoadError, match=spec):
            LLMEngine(EngineConfig(model=spec, dtype="float32"))


def test_missing_model_file(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(ModelLoadError, match=str(missing)):
        LLMEngine(EngineConfig(model=str(missing), dtype="float32"))


def test_truncated_gguf(gguf_path: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    with gguf_path.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(1 << 20))
    with pytest.raises(ModelLoadError, match=str(truncated)):
        LLMEngine(EngineConfig(model=str(truncated), dtype="float32"))


# --- stop conditions ------------------------------------------------------------------------------


def test_stop_strings_end_output_before_the_string(our_gguf_model: Any, chat_ids: list[int]) -> None:
    engine = _engine(our_gguf_model)
    tokens, full, last = _run(engine, "free", chat_ids, _params(max_tokens=24))
    assert "Paris" in full and last.finish_reason == FinishReason.STOP  # EOS after the answer

    stopped_tokens, text, last = _run(engine, "stop", chat_ids, _params(max_tokens=24, stop=["Paris"]))
    assert text == full[:full.index("Paris")]
    assert last.finish_reason == FinishReason.STOP
    assert len(stopped_tokens) < len(tokens) and stopped_tokens == tokens[:len(stopped_tokens)]

    # The earliest of several stop strings wins, whatever their order in the list.
    first = min(full.index("France"), full.index("capital"))
    _, text, _ = _run(engine, "multi", chat_ids, _params(max_tokens=24, stop=["France", "capital"]))
    assert text == full[:first]
    # A stop string that never appears changes nothing.
    again, text, _ = _run(engine, "absent", chat_ids, _params(max_tokens=24, stop=["Berlin"]))
    assert (again, text) == (tokens, full)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


@pytest.mark.parametrize("max_tokens", [1, 7, 33])
def test_max_tokens_respected(our_gguf_model: Any, text_ids: list[int], max_tokens: int) -> None:
    engine = _engine(our_gguf_model)
    tokens, _, last = _run(engine, "n", text_ids[:30], _params(max_tokens=max_tokens, ignore_eos=True))
    assert len(tokens) == max_tokens == last.num_output_tokens
    assert last.finish_reason == FinishReason.LENGTH


# --- AsyncEngine ----------------------------------------------------------------------------------


async def _collect(engine: AsyncEngine, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    out: list[int] = []
    async for o in engine.generate(prompt, params, request_id=rid):
        out += o.new_token_ids
    return out


async def test_async_concurrent_generate(our_gguf_model: Any, solo: LLMEngine, text_ids: list[int]) -> None:
    prompts = [text_ids[:12], text_ids[20:70], text_ids[3:8], text_ids[40:73]]
    params = [_params(max_tokens=6 + 3 * i) for i in range(4)]
    engine = AsyncEngine(EngineConfig(dtype="float32", num_kv_blocks=96), loaded=our_gguf_model)
    try:
        streams = [_collect(engine, p, sp, f"r{i}")
                   for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
        got = await asyncio.wait_for(asyncio.gather(*streams), timeout=120)
        assert got == _alone(solo, prompts, params)
        with pytest.raises(InvalidRequestError, match=r"^top_p"):
            await _collect(engine, prompts[0], _params(top_p=2.0), "bad")
        stats = await engine.stats()
        assert stats["free_blocks"] == stats["total_blocks"] and stats["running"] == 0
    finally:
        engine.shutdown()


async def test_async_cancel_mid_stream_frees_blocks(our_gguf_model: Any, solo: LLMEngine,
                                                    text_ids: list[int]) -> None:
    engine = AsyncEngine(EngineConfig(dtype="float32", num_kv_blocks=96), loaded=our_gguf_model)
    try:
        other = asyncio.create_task(_collect(engine, text_ids[:25], _params(max_tokens=20), "other"))
        seen = 0
        async for o in engine.generate(text_ids[30:90], _params(max_tokens=2000, ignore_eos=True), "cancel"):
            seen += len(o.new_token_ids)
            if seen >= 3:
                break
        # The consumer left: the request is aborted (within one step), not run to 2000 tokens.
        assert await asyncio.wait_for(other, 60) == _alone(solo, [text_ids[:25]], [_params(max_tokens=20)])[0]
        deadline = time.monotonic() + 20
        while True:
            stats = await engine.stats()
            if "cancel" not in engine.engine.requests and stats["free_blocks"] == stats["total_blocks"]:
                break
            assert time.monotonic() < deadline, f"blocks not freed after cancel: {stats}"
            await asyncio.sleep(0.05)
        assert stats["running"] == 0 and stats["waiting"] == 0
    finally:
        engine.shutdown()
