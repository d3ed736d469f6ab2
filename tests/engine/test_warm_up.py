"""The engine's warm-up (run at start on CUDA, callable anywhere): every kind of step once, then nothing left
behind: no request, every block free, no prefix-cache entry or counter, and the same tokens afterwards."""

from __future__ import annotations

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.text.sampling_params import SamplingParams


def _engine(max_model_len: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", device="cpu",
                                  max_model_len=max_model_len, max_prefill_chunk=256, max_num_batched_tokens=512))


@pytest.mark.parametrize("max_model_len", [256, 1024])
def test_warm_up_leaves_nothing_behind(max_model_len: int) -> None:
    engine = _engine(max_model_len)
    bm = engine.block_manager
    out = engine.warm_up()
    # 3 short prompts, one of a chunk's tokens, and (room permitting) one continued after its first chunk
    assert out["requests"] == (5 if max_model_len > 256 + LLMEngine.WARM_UP_TAIL + 8 else 4)
    assert out["steps"] >= 5
    assert not engine.requests and not engine.has_work()
    assert bm.num_free_blocks == bm.num_blocks and bm.num_cached_blocks == 0
    assert bm.enable_prefix_caching and bm.num_prefix_lookups == 0 and bm.num_prefix_hit_tokens == 0
    assert engine.scheduler.num_preemptions == 0


def test_tokens_after_a_warm_up_equal_a_fresh_engine() -> None:
    prompts = [[(5 * i + j) % 500 for i in range(40 + 13 * j)] for j in range(3)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fresh = _engine(1024).generate(prompts, sp)
    warmed = _engine(1024)
    warmed.warm_up()
    assert warmed.generate(prompts, sp) == fresh
    # the prefix cache works as before: the same prompts again hit it
    assert warmed.generate(prompts, sp) == fresh and warmed.block_manager.num_prefix_hit_tokens > 0


@pytest.mark.parametrize("extra", [dict(num_kv_blocks=12), dict(num_kv_blocks=40, max_num_seqs=1),
                                   dict(async_scheduling="on"), dict(num_kv_blocks=3)])
def test_warm_up_fits_small_pools_and_other_step_loops(extra: dict) -> None:
    """A pool too small for every warm-up prompt runs the ones that fit (none at all: no step), one sequence at a
    time queues them, async steps resolve them; each leaves every block free."""
    engine = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", device="cpu", max_model_len=1024,
                                    max_prefill_chunk=256, max_num_batched_tokens=512, **extra))
    bm = engine.block_manager
    out = engine.warm_up()
    assert not engine.requests and not engine.has_work() and bm.num_free_blocks == bm.num_blocks
    assert bm.num_cached_blocks == 0 and engine.scheduler.num_preemptions == 0
    room = bm.num_blocks // 2 * 16
    if room < 37 + 8:
        assert out["requests"] == 0 and out["steps"] == 0
    else:
        assert out["requests"] >= 1 and out["steps"] >= 1
