"""A TP=2 engine (rank 0 here, rank 1 a process it starts): greedy tokens and pages equal TP=1's; a rank
that dies kills the engine loop (the service's NOT_SERVING path)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.parallel.launch import RankDiedError
from services.text.sampling_params import SamplingParams

PROMPTS = [[5, 9, 200, 31, 7, 7, 64, 300, 12, 1, 99, 4, 4, 8, 100, 20, 21], [17, 254, 3, 80, 80, 81]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _cfg(tp: int, spec: str = "random:tiny-qwen3") -> EngineConfig:
    return EngineConfig(model=spec, dtype="float32", block_size=4, num_kv_blocks=64, cpu_threads=1,
                        max_prefill_chunk=8, tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def tp1() -> LLMEngine:
    return LLMEngine(_cfg(1))


@pytest.fixture(scope="module")
def tp2():
    eng = LLMEngine(_cfg(2))
    yield eng
    eng.runner.release()


def test_tp2_greedy_tokens_equal_tp1(tp1: LLMEngine, tp2: LLMEngine) -> None:
    want = tp1.generate(PROMPTS, GREEDY)
    assert tp2.generate(PROMPTS, GREEDY) == want
    assert tp2.runner.kv_cache.shape[-2] == 1 and tp1.runner.kv_cache.shape[-2] == 2  # each rank: its KV head


def test_tp2_pages_cross_the_boundary_with_all_heads(tp1: LLMEngine, tp2: LLMEngine) -> None:
    ids = [0, 1, 2]
    for eng in (tp1, tp2):
        eng.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0))
    full1, full2 = tp1.runner.read_pages(ids), tp2.runner.read_pages(ids)
    assert full2.shape == full1.shape and torch.allclose(full1, full2, atol=1e-5)
    # Pages written through rank 0 land in every rank's shard: read back equal (incl. the fp8 codec).
    fresh = torch.randn_like(full1)
    tp2.runner.write_pages([40, 41, 42], fresh)
    assert torch.equal(tp2.runner.read_pages([40, 41, 42]), fresh)
    fp8 = tp1.runner.read_pages(ids, "fp8-e4m3")
    assert fp8.dtype == torch.uint8 and tp2.runner.read_pages(ids, "fp8-e4m3").shape == fp8.shape
    tp2.runner.write_pages([50, 51, 52], fp8, "fp8-e4m3")
    tp1.runner.write_pages([50, 51, 52], fp8, "fp8-e4m3")
    assert torch.equal(tp2.runner.read_pages([50, 51, 52]), tp1.runner.read_pages([50, 51, 52]))


def _prefill_pages(eng: LLMEngine) -> tuple[torch.Tensor, int]:
    """(full-head pages of PROMPTS[0]'s prefill, its first token) computed by ``eng``."""
    seen: list[tuple[list[int], int]] = []
    listener = lambda ch, s: seen.append((list(ch.seq.block_table), s.token)) if s is not None else None  # noqa: E731
    eng.chunk_listeners.append(listener)
    try:
        eng.generate([PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0))
    finally:
        eng.chunk_listeners.remove(listener)
    table, first = seen[-1]
    return eng.runner.read_pages(table[: -(-len(PROMPTS[0]) // 4)]), first


def _decode_from_pages(eng: LLMEngine, pages_first: tuple[torch.Tensor, int]) -> list[int]:
    """Decode PROMPTS[0] on ``eng`` from imported pages (the decode side of a handoff)."""
    pages, first = pages_first
    seq, _ = eng.add_kv_import("imported", PROMPTS[0], GREEDY, detokenize=False)
    eng.runner.write_pages(seq.block_table[: pages.shape[0]], pages)
    out = [t for o in eng.kv_import_done("imported", first, None) or [] for t in o.new_token_ids]
    while eng.has_work():
        out += [t for o in eng.step() for t in o.new_token_ids]
    return out


def test_tp4_with_replicated_kv_heads_moves_pages_and_tokens_like_tp1(tp1: LLMEngine) -> None:
    """2 KV heads over 4 ranks: an import scatters each rank its (replicated) head, an export gathers one
    copy of each; tokens equal TP=1's."""
    eng = LLMEngine(_cfg(4))
    try:
        assert eng.generate(PROMPTS, GREEDY) == tp1.generate(PROMPTS, GREEDY)
        fresh = torch.randn_like(tp1.runner.read_pages([0, 1]))
        eng.runner.write_pages([60, 61], fresh)
        assert torch.equal(eng.runner.read_pages([60, 61]), fresh)
        # Decode from imported pages: every rank (replicas too) must hold its head of them.
        assert _decode_from_pages(eng, _prefill_pages(tp1)) == tp1.generate([PROMPTS[0]], GREEDY)[0]
    finally:
        eng.runner.release()


def test_a_dead_rank_ends_the_request_and_kills_the_engine_loop() -> None:
    async def run() -> None:
        eng = await asyncio.to_thread(AsyncEngine, _cfg(2, "random:tiny-llama"))
        deaths: list[BaseException] = []
        eng.add_death_callback(deaths.append)
        try:
            first = []
            with pytest.raises(EngineDeadError):
                async for out in eng.generate(PROMPTS[0], SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                                         temperature=0.0)):
                    if not first:
                        first.append(out)
                        os.kill(eng.engine.ranks.procs[0].pid, signal.SIGKILL)
            assert first, "no token before the rank died"
            for _ in range(100):
                if deaths:
                    break
                await asyncio.sleep(0.1)
            assert deaths and isinstance(eng.dead, (RankDiedError, RuntimeError))
            assert "rank 1" in str(eng.engine.ranks.failed)
        finally:
            eng.shutdown()

    asyncio.run(run())
