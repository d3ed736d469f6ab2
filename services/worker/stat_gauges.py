"""The engine-stats gauges prefill and decode publish after each engine step."""

from __future__ import annotations

from collections.abc import Callable

from services.common.metrics import MetricGroup

STAT_GAUGES = {"running": "running_requests", "waiting": "waiting_requests",
               "waiting_for_kv": "waiting_for_kv_requests", "kv_usage": "kv_cache_usage_ratio",
               "cpu_threads": "cpu_threads", "compiled_step_batch_sizes": "compiled_step_batch_sizes",
               "step_compile_seconds": "step_compile_seconds"}
"""Engine stats key -> the gauge attribute of a service's metric group that shows it."""


def stat_gauges(metrics: MetricGroup, model: Callable[[], str]) -> Callable[[dict[str, float]], None]:
    """An ``EngineService.on_stats`` callback: sets each gauge of STAT_GAUGES that ``metrics`` has, labelled
    with ``model()`` (read at each call: the model id is known once the engine has loaded)."""
    gauges = [(key, getattr(metrics, attr)) for key, attr in STAT_GAUGES.items() if hasattr(metrics, attr)]

    def publish(stats: dict[str, float]) -> None:
        for key, gauge in gauges:
            gauge.labels(model()).set(stats[key])

    return publish
