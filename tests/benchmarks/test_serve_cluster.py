"""``bench serve`` against a live local 1P1D cluster: the counts it reports equal the servers' own
counters over the same window, and its TTFT agrees with the router's client-TTFT histogram.

Tolerance for TTFT: the client's p50 must lie in the bucket that holds the router's p50 (the
histogram cannot place a value more finely than its bucket: services/common/metrics.py
LATENCY_BUCKETS), widened by 50 ms on each side for what only the client sees (the HTTP response
head and SSE parsing on loopback, this test process's event loop on a busy host). The client's
TTFT starts before the router's (request sent vs request arrived), so its p50 may not be more than
those 50 ms below the bucket either."""

from __future__ import annotations

import pytest

from benchmarks.serve.config import LoadConfig, ReportConfig, TargetConfig, WorkloadConfig
from benchmarks.serve.sweep import run_sweep
from services.common import metrics as m
from services.launcher import LocalCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SLACK_S = 0.050


@pytest.fixture(scope="module")
def cluster():
    kv = ["--kv-cache-bytes", str(128 << 20)]
    with LocalCluster(prefill=1, decode=1, kvstore=None, extra={"prefill": kv, "decode": kv}, quiet=True) as c:
        yield c


def test_counts_and_ttft_agree_with_the_servers(cluster):
    metrics = tuple(info["metrics"] for info in cluster.endpoints().values() if "metrics" in info)
    t = TargetConfig(base_url=f"http://{cluster.router['http']}/v1", metrics_urls=metrics, timeout_s=120)
    w = WorkloadConfig(workload="random", input_tokens=48, input_spread=0.3, output_tokens=6, seed=5)
    load = LoadConfig(concurrency=(2,), requests=8, warmup=1)
    sweep = run_sweep("live", t, w, load, ReportConfig(progress=False), say=lambda _m: None)
    s = sweep.points[0]
    assert s["requests"] == {**s["requests"], "sent": 8, "completed": 8, "failed": 0, "not_sent": 0}
    c = s["server"]["counters"]
    # Token counts: the reported ones (usage) equal the router's counters; the client's own tokenizer
    # gives the same prompt counts (chat template and all). Re-tokenizing the output text may merge
    # tokens the model emitted split, so that count may only fall a little short.
    assert s["tokens"]["source"] == "usage"
    assert s["tokens"]["input"] == c["router_prompt_tokens"] == s["tokens"]["client_tokenizer_input"]
    assert s["tokens"]["output"] == c["router_generation_tokens"] == 8 * 6
    assert 0.85 * 8 * 6 <= s["tokens"]["client_tokenizer_output"] <= 8 * 6
    # Prefill samples each request's first token; decode the rest (docs/METRICS.md, token accounting).
    assert c["decode_generation_tokens"] + 8 == c["router_generation_tokens"]
    assert c["router_requests_ok"] == 8
    # The window holds exactly the measured requests (warmup excluded) on the server side too.
    assert s["server"]["histograms"]["router_ttft"]["count"] == 8
    assert s["server"]["histograms"]["decode_kv_wait"]["count"] == 8

    # TTFT: client p50 within the router's p50 bucket, +- SLACK_S.
    window = sweep.points[0]["server"]
    router_p50 = window["histograms"]["router_ttft"]["p50"]
    assert router_p50 is not None
    lo, hi = _bucket(router_p50)
    client_p50 = s["ttft_s"]["p50"]
    assert lo - SLACK_S <= client_p50 <= hi + SLACK_S, (client_p50, router_p50, (lo, hi))


def _bucket(v: float) -> tuple[float, float]:
    lower = 0.0
    for le in m.LATENCY_BUCKETS:
        if v <= le:
            return lower, le
        lower = le
    return lower, float("inf")
