"""The engine-stats gauges: each service publishes the stats its metric group has a gauge for."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.common import metrics as m
from services.worker.stat_gauges import stat_gauges

STATS = {"running": 3.0, "waiting": 2.0, "waiting_for_kv": 1.0, "kv_usage": 0.25, "free_blocks": 9.0,
         "cpu_threads": 2.0, "compiled_step_batch_sizes": 1.0, "step_compile_seconds": 40.5}


def test_decode_publishes_all_seven_and_prefill_its_three() -> None:
    for group, want in ((m.DecodeMetrics, {m.DECODE_RUNNING_REQUESTS: 3.0, m.DECODE_WAITING_REQUESTS: 2.0,
                                           m.DECODE_WAITING_FOR_KV_REQUESTS: 1.0, m.DECODE_KV_CACHE_USAGE_RATIO: 0.25,
                                           m.DECODE_CPU_THREADS: 2.0, m.DECODE_COMPILED_STEP_BATCH_SIZES: 1.0,
                                           m.DECODE_STEP_COMPILE_SECONDS: 40.5}),
                        (m.PrefillMetrics, {m.PREFILL_RUNNING_REQUESTS: 3.0, m.PREFILL_WAITING_REQUESTS: 2.0,
                                            m.PREFILL_CPU_THREADS: 2.0})):
        registry = CollectorRegistry()
        model = ["loading"]
        publish = stat_gauges(group(registry), lambda model=model: model[0])
        model[0] = "smol"  # the label is read at publish time: the id is known once the engine loaded
        publish(STATS)
        got = {s.name: s.value for fam in registry.collect() for s in fam.samples
               if fam.type == "gauge" and s.labels.get("model") == "smol"}
        assert got == want, group.__name__
