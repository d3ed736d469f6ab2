"""The engine step metrics move when the engine steps: durations, tokens and sequences per step, eager steps
on CPU, busy seconds and the busy ratio."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.text.sampling_params import SamplingParams
from services.worker import step_metrics
from services.worker.step_metrics import StepMetrics


@pytest.mark.parametrize("group,prefix", [(m.DecodeMetrics, "pdserve_decode"), (m.PrefillMetrics, "pdserve_prefill")])
async def test_step_metrics_follow_the_engine(group, prefix, monkeypatch) -> None:
    monkeypatch.setattr(step_metrics, "BUSY_WINDOW_S", 0.0)
    registry = CollectorRegistry()
    engine = await asyncio.to_thread(AsyncEngine, EngineConfig(model="random:tiny-llama", dtype="float32",
                                                               num_kv_blocks=64, max_prefill_chunk=16))
    try:
        publish = StepMetrics(group(registry), lambda: engine, lambda: "tiny")
        publish({})

        def value(name: str, **labels: str) -> float:
            return registry.get_sample_value(prefix + name, {"model": "tiny", **labels}) or 0.0

        assert value("_engine_step_seconds_count") == 0
        prompts = [[(i * 7 + j) % 200 + 1 for j in range(40)] for i in range(3)]
        t0 = time.monotonic()

        async def run(ids: list[int]) -> None:
            async for _ in engine.generate(ids, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                                           detokenize=False):
                pass

        await asyncio.gather(*(run(p) for p in prompts))
        wall = time.monotonic() - t0
        publish({})
        steps = value("_engine_step_seconds_count")
        assert steps >= 5  # three 40-token prompts in 16-token chunks, then decode steps
        assert value("_engine_steps_total", cuda_graph="eager") == steps  # CPU: no CUDA graph
        assert value("_engine_steps_total", cuda_graph="graphed") == 0
        # Every prompt token and every decode row went through some step: 3 x 40 prefill + 3 x 4 decode rows.
        assert value("_engine_step_tokens_sum") == 3 * 40 + 3 * 4
        assert value("_engine_step_sequences_count") == steps
        assert 1 <= value("_engine_step_sequences_sum") / steps <= 3
        busy = value("_engine_busy_seconds_total")
        assert 0 < busy <= wall + 0.5
        assert abs(value("_engine_step_seconds_sum") - busy) < 1e-6
        assert 0 < value("_engine_busy_ratio") <= 1
        publish({})  # nothing new: nothing moves
        assert value("_engine_step_seconds_count") == steps and value("_engine_busy_seconds_total") == busy
    finally:
        engine.shutdown()
