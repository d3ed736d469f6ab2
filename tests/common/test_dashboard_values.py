"""Every Grafana panel query shows the right number: a real Prometheus holds series whose rates, gauges and
histogram observations are known (backfilled at known timestamps), and each query's answer is compared
with the value a reader of the panel expects, worked out here from those inputs.

Inputs are exact by construction: a counter with rate r/s is `r * t` at every sample (5 s apart), so
`rate()` over any window is r; a histogram observes one value v at r/s, so its mean is v and
`histogram_quantile(q)` interpolates to `lo + q * (hi - lo)` inside the bucket (lo, hi] holding v.
The same series, 1000 times larger, sit in another namespace, which the dashboards' filter must drop.
Series carry `pod` as the Kubernetes scrape configs set it (tests/deploy/test_k8s_autoscaling.py reads it).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from services.common import metrics as m
from tests.common.test_dashboards import _exprs, _substitute
from tests.prom_harness import TEST_NAMESPACE, PrometheusHarness, promtool_binary, require_prometheus

STEP_S = 5
SAMPLES = 121  # 10 minutes of history: longer than any window the dashboards use after substitution
OTHER_NAMESPACE = "elsewhere"
OTHER_SCALE = 1000.0
MODEL = "tiny"


@dataclass(frozen=True)
class Series:
    """One series of a metric on one instance: a counter's rate (1/s), a gauge's value, or a histogram
    observing ``value`` at ``rate`` per second."""

    metric: str
    instance: str
    labels: dict[str, str] = field(default_factory=dict)
    rate: float = 0.0
    value: float = 0.0


def _c(metric: str, instance: str, rate: float, **labels: str) -> Series:
    return Series(metric, instance, labels, rate=rate)


def _g(metric: str, instance: str, value: float, **labels: str) -> Series:
    return Series(metric, instance, labels, value=value)


def _h(metric: str, instance: str, value: float, rate: float = 10.0, **labels: str) -> Series:
    return Series(metric, instance, labels, rate=rate, value=value)


R, R2, P0, P1, D0, D1, K = ("router-0:9100", "router-1:9100", "prefill-0:9100", "prefill-1:9100",
                            "decode-0:9100", "decode-1:9100", "kvstore-0:9100")
MD = {"model": MODEL}

SERIES: tuple[Series, ...] = (
    # router: 10 requests/s, of which 1.1/s fail (an 11% error share)
    _c(m.ROUTER_REQUESTS_TOTAL, R, 7.0, status="ok", finish_reason="stop", **MD),
    _c(m.ROUTER_REQUESTS_TOTAL, R, 1.9, status="ok", finish_reason="length", **MD),
    _c(m.ROUTER_REQUESTS_TOTAL, R, 1.1, status="error", finish_reason="error", **MD),
    _c(m.ROUTER_ERRORS_TOTAL, R, 0.8, code="unavailable", **MD),
    _c(m.ROUTER_ERRORS_TOTAL, R, 0.3, code="deadline_exceeded", **MD),
    _c(m.ROUTER_PROMPT_TOKENS_TOTAL, R, 500.0, **MD),
    _c(m.ROUTER_GENERATION_TOKENS_TOTAL, R, 120.0, **MD),
    _c(m.ROUTER_DISPATCH_RETRIES_TOTAL, R, 0.2, role="prefill", reason="unavailable"),
    _c(m.ROUTER_DISPATCH_RETRIES_TOTAL, R, 0.05, role="decode", reason="timeout"),
    _g(m.ROUTER_INFLIGHT_REQUESTS, R, 3.0, **MD),
    _g(m.ROUTER_INFLIGHT_REQUESTS, R2, 2.0, **MD),
    _g(m.ROUTER_INSTANCE_HEALTHY, R, 1.0, role="prefill", endpoint="10.0.0.1:50052"),
    _g(m.ROUTER_INSTANCE_HEALTHY, R, 1.0, role="prefill", endpoint="10.0.0.2:50052"),
    _g(m.ROUTER_INSTANCE_HEALTHY, R, 1.0, role="decode", endpoint="10.0.0.3:50053"),
    _g(m.ROUTER_INSTANCE_HEALTHY, R, 0.0, role="decode", endpoint="10.0.0.4:50053"),
    _h(m.ROUTER_TTFT_SECONDS, R, 0.4, **MD),
    _h(m.ROUTER_ITL_SECONDS, R, 0.035, **MD),
    _h(m.ROUTER_E2E_SECONDS, R, 2.5, **MD),
    _h(m.ROUTER_HANDOFF_PHASE_SECONDS, R, 0.0003, phase="reserve"),
    _h(m.ROUTER_HANDOFF_PHASE_SECONDS, R, 0.004, phase="claim"),
    # prefill: two instances
    _h(m.PREFILL_QUEUE_SECONDS, P0, 0.03, **MD),
    _h(m.PREFILL_QUEUE_SECONDS, P1, 0.03, rate=0.0, **MD),  # a pod that queued nothing: its quantile is NaN
    _h(m.PREFILL_COMPUTE_SECONDS, P0, 0.12, **MD),
    _h(m.PREFILL_HANDOFF_PHASE_SECONDS, P0, 0.0004, phase="reserve"),
    _h(m.PREFILL_HANDOFF_PHASE_SECONDS, P1, 0.0004, phase="reserve", rate=5.0),
    _h(m.PREFILL_HANDOFF_PHASE_SECONDS, P0, 0.06, phase="import"),
    _c(m.PREFILL_CHUNKS_TOTAL, P0, 30.0, **MD),
    _c(m.PREFILL_CHUNKS_TOTAL, P1, 10.0, **MD),
    _c(m.PREFILL_COMPUTED_TOKENS_TOTAL, P0, 400.0, **MD),
    _c(m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, P0, 60.0, source="local", **MD),
    _c(m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, P1, 40.0, source="kvstore", **MD),
    _c(m.PREFILL_KV_SKIPPED_TOKENS_TOTAL, P0, 25.0, **MD),
    _c(m.PREFILL_KV_SENT_BYTES_TOTAL, P0, 1e6, transport="grpc"),
    _c(m.PREFILL_KV_SENT_BYTES_TOTAL, P1, 3e6, transport="mooncake"),
    _c(m.PREFILL_KV_CHUNKS_SENT_TOTAL, P0, 20.0, transport="grpc"),
    _c(m.PREFILL_KV_CHUNKS_SENT_TOTAL, P1, 30.0, transport="mooncake"),
    _c(m.PREFILL_KV_TRANSFER_FAILURES_TOTAL, P0, 0.1, transport="grpc", reason="unavailable"),
    _g(m.PREFILL_RUNNING_REQUESTS, P0, 3.0, **MD),
    _g(m.PREFILL_RUNNING_REQUESTS, P1, 1.0, **MD),
    _g(m.PREFILL_WAITING_REQUESTS, P0, 2.0, **MD),
    _g(m.PREFILL_WAITING_REQUESTS, P1, 4.0, **MD),
    # decode: two instances
    _h(m.DECODE_KV_WAIT_SECONDS, D0, 0.18, **MD),
    _h(m.DECODE_KV_TRANSFER_EXPOSED_SECONDS, D0, 0.04, **MD),
    _h(m.DECODE_QUEUE_SECONDS, D0, 0.008, **MD),
    _h(m.DECODE_TPOT_SECONDS, D0, 0.033, **MD),
    _h(m.DECODE_HANDOFF_PHASE_SECONDS, D1, 0.0007, phase="claim"),
    _c(m.DECODE_KV_RECEIVED_BYTES_TOTAL, D0, 0.9e6, transport="grpc"),
    _c(m.DECODE_KV_RECEIVED_BYTES_TOTAL, D1, 2.9e6, transport="mooncake"),
    _c(m.DECODE_KV_CHUNKS_RECEIVED_TOTAL, D0, 18.0, transport="grpc"),
    _c(m.DECODE_KV_CHUNKS_RECEIVED_TOTAL, D1, 29.0, transport="mooncake"),
    _c(m.DECODE_KV_CHUNKS_REJECTED_TOTAL, D0, 0.02, reason="checksum"),
    _c(m.DECODE_RESERVATIONS_EXPIRED_TOTAL, D1, 0.01, **MD),
    _g(m.DECODE_KV_CACHE_USAGE_RATIO, D0, 0.35, **MD),
    _g(m.DECODE_KV_CACHE_USAGE_RATIO, D1, 0.8, **MD),
    _g(m.DECODE_RUNNING_REQUESTS, D0, 5.0, **MD),
    _g(m.DECODE_RUNNING_REQUESTS, D1, 7.0, **MD),
    _g(m.DECODE_WAITING_REQUESTS, D0, 1.0, **MD),
    _g(m.DECODE_WAITING_REQUESTS, D1, 2.0, **MD),
    _g(m.DECODE_WAITING_FOR_KV_REQUESTS, D0, 2.0, **MD),
    _g(m.DECODE_WAITING_FOR_KV_REQUESTS, D1, 0.0, **MD),
    _c(m.DECODE_GENERATION_TOKENS_TOTAL, D0, 60.0, **MD),
    _c(m.DECODE_GENERATION_TOKENS_TOTAL, D1, 50.0, **MD),
    _c(m.DECODE_SPEC_DRAFT_TOKENS_TOTAL, D0, 100.0, acceptance="real", **MD),
    _c(m.DECODE_SPEC_ACCEPTED_TOKENS_TOTAL, D0, 70.0, acceptance="real", **MD),
    _c(m.DECODE_SPEC_DRAFT_TOKENS_TOTAL, D1, 50.0, acceptance="synthetic", **MD),
    _c(m.DECODE_SPEC_ACCEPTED_TOKENS_TOTAL, D1, 40.0, acceptance="synthetic", **MD),
    _h(m.DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS, D0, 2.5, acceptance="real", **MD),
    _h(m.DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS, D1, 4.5, acceptance="synthetic", **MD),
    # engine steps: prefill-0 steps eagerly, decode-0 replays 4 of 5 steps in a CUDA graph
    _h(m.PREFILL_ENGINE_STEP_SECONDS, P0, 0.07, **MD),
    _h(m.DECODE_ENGINE_STEP_SECONDS, D0, 0.015, **MD),
    _h(m.PREFILL_ENGINE_STEP_TOKENS, P0, 300.0, **MD),
    _h(m.PREFILL_ENGINE_STEP_SEQUENCES, P0, 3.0, **MD),
    _h(m.DECODE_ENGINE_STEP_TOKENS, D0, 12.0, **MD),
    _h(m.DECODE_ENGINE_STEP_SEQUENCES, D0, 11.0, **MD),
    _g(m.PREFILL_ENGINE_BUSY_RATIO, P0, 0.6, **MD),
    _g(m.PREFILL_ENGINE_BUSY_RATIO, P1, 0.2, **MD),
    _g(m.DECODE_ENGINE_BUSY_RATIO, D0, 0.9, **MD),
    _c(m.PREFILL_ENGINE_BUSY_SECONDS_TOTAL, P0, 0.5, **MD),
    _c(m.PREFILL_ENGINE_BUSY_SECONDS_TOTAL, P1, 0.3, **MD),
    _c(m.DECODE_ENGINE_BUSY_SECONDS_TOTAL, D0, 0.85, **MD),
    _c(m.DECODE_ENGINE_STEPS_TOTAL, D0, 40.0, cuda_graph="graphed", **MD),
    _c(m.DECODE_ENGINE_STEPS_TOTAL, D0, 10.0, cuda_graph="eager", **MD),
    _c(m.PREFILL_ENGINE_STEPS_TOTAL, P0, 5.0, cuda_graph="eager", **MD),
    # kvstore
    _c(m.KVSTORE_HITS_TOTAL, K, 30.0, tier="memory"),
    _c(m.KVSTORE_MISSES_TOTAL, K, 10.0, tier="memory"),
    _c(m.KVSTORE_HITS_TOTAL, K, 5.0, tier="disk"),
    _c(m.KVSTORE_MISSES_TOTAL, K, 15.0, tier="disk"),
    _c(m.KVSTORE_EVICTIONS_TOTAL, K, 2.0, tier="memory"),
    _c(m.KVSTORE_CORRUPT_TOTAL, K, 0.5, tier="disk"),
    _g(m.KVSTORE_STORED_BYTES, K, 1e9, tier="memory"),
    _g(m.KVSTORE_STORED_BYTES, K, 4e9, tier="disk"),
    _g(m.KVSTORE_ENTRIES, K, 1000.0, tier="memory"),
    _g(m.KVSTORE_ENTRIES, K, 5000.0, tier="disk"),
    _c(m.KVSTORE_GET_BYTES_TOTAL, K, 2e6),
    _c(m.KVSTORE_PUT_BYTES_TOTAL, K, 1e6),
)


def _quantile(metric: str, q: float) -> float:
    """histogram_quantile(q) of ``metric`` when all its observations are its SERIES' value."""
    (v,) = {s.value for s in SERIES if s.metric == metric}
    bounds = m.SPECS_BY_NAME[metric].buckets
    hi = next(b for b in bounds if b >= v)
    lo = bounds[bounds.index(hi) - 1]
    assert lo < v < hi and bounds.index(hi) > 0, f"{metric}: put {v} strictly inside a bucket, not the first"
    return lo + q * (hi - lo)


Expected = dict[str, float]
"""Result series (their labels as `k=v,...` sorted; "" for none) -> value."""

_P50_P99 = (0.5, 0.99)
EXPECTED: dict[str, Expected] = {
    "Request rate by status / A": {"status=ok": 8.9, "status=error": 1.1},
    "Error rate / A": {"": 0.11},  # 1.1 errors/s of 10 requests/s
    "Errors by code / A": {"code=unavailable": 0.8, "code=deadline_exceeded": 0.3},
    "Tokens/s in and out / A": {"": 500.0},
    "Tokens/s in and out / B": {"": 120.0},
    "Finish reasons / A": {"finish_reason=stop": 7.0, "finish_reason=length": 1.9},
    "In-flight requests / A": {f"instance={R}": 3.0, f"instance={R2}": 2.0},
    "Healthy backends by role / A": {"role=prefill": 2.0, "role=decode": 1.0},
    "Dispatch retries / A": {"reason=unavailable,role=prefill": 0.2, "reason=timeout,role=decode": 0.05},
    "Exposed transfer share of KV-wait (mean) / A": {"": (10 * 0.04) / (10 * 0.18)},
    "Handoff phases (mean) / A": {"phase=reserve": 0.0003, "phase=claim": 0.004},
    "Handoff phases (mean) / B": {"phase=reserve": 0.0004, "phase=import": 0.06},
    "Handoff phases (mean) / C": {"phase=claim": 0.0007},
    "KV bytes/s by transport / A": {"transport=grpc": 1e6, "transport=mooncake": 3e6},
    "KV bytes/s by transport / B": {"transport=grpc": 0.9e6, "transport=mooncake": 2.9e6},
    "KV chunks/s by transport / A": {"transport=grpc": 20.0, "transport=mooncake": 30.0},
    "KV chunks/s by transport / B": {"transport=grpc": 18.0, "transport=mooncake": 29.0},
    "Transfer failures / A": {"reason=unavailable,transport=grpc": 0.1},
    "Transfer failures / B": {"reason=checksum": 0.02},
    "Transfer failures / C": {"": 0.01},
    "Decode KV cache usage / A": {f"instance={D0}": 0.35, f"instance={D1}": 0.8},
    "Prefill running / waiting / A": {"": 4.0},
    "Prefill running / waiting / B": {"": 6.0},
    "Decode running / waiting / waiting for KV / A": {"": 12.0},
    "Decode running / waiting / waiting for KV / B": {"": 3.0},
    "Decode running / waiting / waiting for KV / C": {"": 2.0},
    "Prefill throughput / A": {"": 400.0},
    "Prefill throughput / B": {"": 40.0},
    "Decode tokens/s / A": {"": 110.0},
    "Speculative decoding: acceptance / A": {"acceptance=real": 0.7, "acceptance=synthetic": 0.8},
    "Speculative decoding: acceptance / B": {"acceptance=real": 2.5, "acceptance=synthetic": 4.5},
    "Cached-prefix tokens skipped/s by source / A": {"source=local": 60.0, "source=kvstore": 40.0},
    "Cached-prefix tokens skipped/s by source / B": {"": 25.0},
    "Prefix hit ratio / A": {"": (60.0 + 40.0) / (60.0 + 40.0 + 400.0)},
    "kvstore hit rate per tier / A": {"tier=memory": 0.75, "tier=disk": 0.25},
    "kvstore evictions and corrupt pages / A": {"tier=memory": 2.0},
    "kvstore evictions and corrupt pages / B": {"tier=disk": 0.5},
    "kvstore stored bytes per tier / A": {"tier=memory": 1e9, "tier=disk": 4e9},
    "kvstore entries per tier and Get/Put bytes/s / A": {"tier=memory": 1000.0, "tier=disk": 5000.0},
    "kvstore entries per tier and Get/Put bytes/s / B": {"": 2e6},
    "kvstore entries per tier and Get/Put bytes/s / C": {"": 1e6},
    "Tokens and sequences per step (mean) / A": {"": 300.0},
    "Tokens and sequences per step (mean) / B": {"": 3.0},
    "Tokens and sequences per step (mean) / C": {"": 12.0},
    "Tokens and sequences per step (mean) / D": {"": 11.0},
    "Engine busy ratio and CUDA-graphed steps / A": {f"instance={P0}": 0.6, f"instance={P1}": 0.2},
    "Engine busy ratio and CUDA-graphed steps / B": {f"instance={D0}": 0.9},
    "Engine busy ratio and CUDA-graphed steps / C": {"": (0.5 + 0.3) / 2},  # busy seconds/s over 2 prefills
    "Engine busy ratio and CUDA-graphed steps / D": {"": 0.85},
    "Engine busy ratio and CUDA-graphed steps / E": {"": 40.0 / 50.0},
    "Engine busy ratio and CUDA-graphed steps / F": {"": 0.0},  # no graphed prefill step: 0, not absent
}
# Latency panels: p50 (A) and p99 (B) of one histogram.
for _title, _metric in (("Client TTFT", m.ROUTER_TTFT_SECONDS), ("Inter-token latency (ITL)", m.ROUTER_ITL_SECONDS),
                        ("End-to-end latency", m.ROUTER_E2E_SECONDS), ("Prefill queue", m.PREFILL_QUEUE_SECONDS),
                        ("Decode queue", m.DECODE_QUEUE_SECONDS), ("TPOT", m.DECODE_TPOT_SECONDS),
                        ("Prefill compute (p50/p99)", m.PREFILL_COMPUTE_SECONDS)):
    for _ref, _q in zip("AB", _P50_P99, strict=True):
        EXPECTED[f"{_title} / {_ref}"] = {"": _quantile(_metric, _q)}
# Engine step duration: prefill p50 (A) and p99 (B), decode p50 (C) and p99 (D).
for _refs, _metric in (("AB", m.PREFILL_ENGINE_STEP_SECONDS), ("CD", m.DECODE_ENGINE_STEP_SECONDS)):
    for _ref, _q in zip(_refs, _P50_P99, strict=True):
        EXPECTED[f"Step duration (p50/p99) / {_ref}"] = {"": _quantile(_metric, _q)}
# The TTFT breakdown: decode KV-wait (A), exposed transfer (B), prefill compute (C) at p50 and at p99.
for _suffix, _q in (("(p50)", 0.5), ("(p99)", 0.99)):
    for _ref, _metric in zip("ABC", (m.DECODE_KV_WAIT_SECONDS, m.DECODE_KV_TRANSFER_EXPOSED_SECONDS,
                                     m.PREFILL_COMPUTE_SECONDS), strict=True):
        EXPECTED[f"KV-wait vs exposed transfer vs prefill compute {_suffix} / {_ref}"] = {"": _quantile(_metric, _q)}

OLD_ERROR_RATE = ("(sum (rate(pdserve_router_errors_total{$sel}[$__rate_interval]))) or on() vector(0)"
                  " / sum (rate(pdserve_router_requests_total{$sel}[$__rate_interval]))")
"""The Error rate panel before its fix: `/` binds tighter than `or`, so it plotted errors per second."""


# --- the series as OpenMetrics ---------------------------------------------------------------------

def _labels(s: Series, namespace: str, extra: dict[str, str] | None = None) -> str:
    spec = m.SPECS_BY_NAME[s.metric]
    assert set(s.labels) <= set(spec.labels), f"{s.metric}: labels {set(s.labels) - set(spec.labels)} not exported"
    labels = {"namespace": namespace, "instance": s.instance, "pod": s.instance.split(":")[0], "job": "pdserve",
              **s.labels, **(extra or {})}
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def _samples(s: Series, elapsed_s: float, scale: float, namespace: str) -> Iterator[tuple[str, float]]:
    kind = m.SPECS_BY_NAME[s.metric].kind
    if kind == "counter":
        yield s.metric + _labels(s, namespace), scale * s.rate * elapsed_s
    elif kind == "gauge":
        yield s.metric + _labels(s, namespace), scale * s.value
    else:
        count = scale * s.rate * elapsed_s
        for bound in (*m.SPECS_BY_NAME[s.metric].buckets, math.inf):
            le = "+Inf" if bound == math.inf else repr(bound)
            yield s.metric + "_bucket" + _labels(s, namespace, {"le": le}), count if s.value <= bound else 0.0
        yield s.metric + "_sum" + _labels(s, namespace), count * s.value
        yield s.metric + "_count" + _labels(s, namespace), count


def openmetrics(start_s: int) -> str:
    """Every series of SERIES, in both namespaces, sampled every STEP_S from ``start_s``. Families are
    typed `gauge` so sample names keep their suffixes as exported (rate() does not read the type)."""
    lines: list[str] = []
    by_family: dict[str, list[Series]] = {}
    for s in SERIES:
        by_family.setdefault(s.metric, []).append(s)
    for metric, series in by_family.items():
        names = m.series_names(metric)
        for name in names:
            lines.append(f"# TYPE {name} gauge")
            for i in range(SAMPLES):
                elapsed = 1000.0 + STEP_S * i  # counters start well above 0: no reset, no extrapolation to zero
                for s in series:
                    for ns, scale in ((TEST_NAMESPACE, 1.0), (OTHER_NAMESPACE, OTHER_SCALE)):
                        for sample, value in _samples(s, elapsed, scale, ns):
                            if sample.split("{", 1)[0] == name:
                                lines.append(f"{sample} {value!r} {start_s + STEP_S * i}")
    lines.append("# EOF")
    return "\n".join(lines) + "\n"


# --- checking --------------------------------------------------------------------------------------

def _key(metric: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(metric.items()))


def mismatches(prom: PrometheusHarness, at: float, where: str, expr: str, expected: Expected) -> list[str]:
    """What differs between ``expr`` evaluated at ``at`` and ``expected`` (empty: the panel is right)."""
    q = _substitute(expr.replace("{$sel}", '{namespace=~"$namespace", instance=~"$instance"}'))
    got = {_key(r["metric"]): float(r["value"][1]) for r in prom.query(q, at=at)}
    if set(got) != set(expected):
        return [f"{where}: series {sorted(got)} != expected {sorted(expected)} for {q}"]
    return [f"{where} {k or '(one series)'}: {got[k]} != {v} for {q}"
            for k, v in expected.items() if not math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-12)]


@pytest.fixture(scope="module")
def known() -> Iterator[tuple[PrometheusHarness, float]]:
    """(Prometheus holding SERIES, the time of their last sample)."""
    require_prometheus()
    if promtool_binary() is None:
        pytest.skip("no promtool (Debian's prometheus package ships it)")
    start = int(time.time()) - 30 * 60
    with PrometheusHarness([], backfill=openmetrics(start)) as prom:
        yield prom, float(start + STEP_S * (SAMPLES - 1))


def _where(full: str) -> str:
    return full.split(" / ", 1)[1]  # drop the dashboard file name: panel titles are unique across both


def test_every_panel_query_has_an_expected_value() -> None:
    wheres = [_where(w) for w, _ in _exprs()]
    assert len(wheres) == len(set(wheres)), "panel titles repeat across dashboards"
    assert set(wheres) == set(EXPECTED), (f"missing: {sorted(set(wheres) - set(EXPECTED))}; "
                                          f"stale: {sorted(set(EXPECTED) - set(wheres))}")


def test_every_panel_shows_the_known_value(known: tuple[PrometheusHarness, float]) -> None:
    prom, at = known
    failures = [f for where, expr in _exprs() for f in mismatches(prom, at, where, expr, EXPECTED[_where(where)])]
    assert not failures, "\n".join(failures)


def test_the_old_error_rate_expression_is_caught(known: tuple[PrometheusHarness, float]) -> None:
    prom, at = known
    expected = EXPECTED["Error rate / A"]
    assert mismatches(prom, at, "old Error rate", OLD_ERROR_RATE, expected) != []
    # What it plotted instead: the 1.1 errors/s.
    assert mismatches(prom, at, "old Error rate", OLD_ERROR_RATE, {"": 1.1}) == []


def test_the_error_rate_is_zero_without_errors_and_absent_without_requests(
        known: tuple[PrometheusHarness, float]) -> None:
    prom, at = known
    (expr,) = [e for w, e in _exprs() if _where(w) == "Error rate / A"]
    no_errors = expr.replace("pdserve_router_errors_total", "pdserve_router_errors_never_total")
    assert mismatches(prom, at, "no errors", no_errors, {"": 0.0}) == []
    no_requests = no_errors.replace("pdserve_router_requests_total", "pdserve_router_requests_never_total")
    assert mismatches(prom, at, "no requests", no_requests, {}) == []
