"""The engine step metrics prefill and decode export: step duration, tokens and sequences per step, CUDA-graphed
steps, time spent stepping and the busy ratio. The engine thread only appends a record per step; these are
observed on the event loop whenever the service reads its stats (every gauge period, and on each load report)."""

from __future__ import annotations

import time
from collections.abc import Callable

from services.common.metrics import MetricGroup
from services.engine.async_engine import AsyncEngine

BUSY_WINDOW_S = 1.0
"""Shortest wall time the busy ratio is computed over (seconds): load reports in between leave it as it is."""


class StepMetrics:
    """An ``EngineService.on_stats`` callback: observes the steps ``engine()`` ran since the previous call
    into ``metrics``' engine step metrics, labelled with ``model()`` (both read at each call: they exist
    once the engine has loaded)."""

    def __init__(self, metrics: MetricGroup, engine: Callable[[], AsyncEngine | None], model: Callable[[], str]
                 ) -> None:
        self._m = metrics
        self._engine = engine
        self._model = model
        self._window_start = time.monotonic()
        self._window_busy = 0.0
        """The engine's busy_s at the window's start (seconds)."""
        self._counted_busy = 0.0
        """Busy seconds already added to the counter."""

    def __call__(self, stats: dict[str, float]) -> None:
        engine = self._engine()
        if engine is None:
            return
        model = self._model()
        m = self._m
        step_s = m.engine_step_seconds.labels(model)  # type: ignore[attr-defined]
        tokens = m.engine_step_tokens.labels(model)  # type: ignore[attr-defined]
        sequences = m.engine_step_sequences.labels(model)  # type: ignore[attr-defined]
        graphed = eager = 0
        for r in engine.take_steps():
            step_s.observe(r.seconds)
            tokens.observe(r.tokens)
            sequences.observe(r.sequences)
            if r.graphed:
                graphed += 1
            else:
                eager += 1
        if graphed:
            m.engine_steps_total.labels(model, "graphed").inc(graphed)  # type: ignore[attr-defined]
        if eager:
            m.engine_steps_total.labels(model, "eager").inc(eager)  # type: ignore[attr-defined]
        busy = engine.busy_s
        if busy > self._counted_busy:
            m.engine_busy_seconds_total.labels(model).inc(busy - self._counted_busy)  # type: ignore[attr-defined]
            self._counted_busy = busy
        now = time.monotonic()
        if now - self._window_start >= BUSY_WINDOW_S:
            ratio = (busy - self._window_busy) / (now - self._window_start)
            m.engine_busy_ratio.labels(model).set(min(1.0, max(0.0, ratio)))  # type: ignore[attr-defined]
            self._window_start, self._window_busy = now, busy
