"""services/common/metrics.py: names, conventions, registries, the /metrics server, docs/METRICS.md."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from services.common import metric_series as ms
from services.common import metrics as m

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "METRICS.md"


def _module_constants() -> dict[str, str]:
    return {k: v for k, v in vars(m).items() if k.isupper() and isinstance(v, str) and v.startswith("pdserve_")}


def test_every_constant_has_a_spec_and_vice_versa() -> None:
    assert set(_module_constants().values()) == set(m.ALL_METRIC_NAMES)
    assert len(m.SPECS) == len(m.ALL_METRIC_NAMES), "duplicate metric name in SPECS"


@pytest.mark.parametrize("spec", m.SPECS, ids=lambda s: s.name)
def test_naming_conventions(spec: m.MetricSpec) -> None:
    assert re.fullmatch(r"pdserve_[a-z0-9_]+", spec.name)
    assert spec.name.startswith(f"pdserve_{spec.service}_")
    assert spec.service in m.SERVICES
    if spec.kind == "counter":
        assert spec.name.endswith("_total")
    else:
        assert not spec.name.endswith("_total")
    if spec.kind == "histogram":
        assert spec.name.endswith(("_seconds", "_tokens", "_sequences"))  # base units: time, a token or sequence count
    if "bytes" in spec.name:
        assert spec.name.endswith(("_bytes", "_bytes_total"))
    assert "instance" not in spec.labels and "namespace" not in spec.labels, "Prometheus owns these labels"
    assert spec.help


def test_buckets_cover_1ms_to_at_least_300s_with_resolution_below_1s() -> None:
    for buckets in (m.LATENCY_BUCKETS, m.TOKEN_BUCKETS):
        assert buckets[0] == 0.001 and buckets[-1] >= 300.0
        assert list(buckets) == sorted(set(buckets))
        assert sum(b < 1.0 for b in buckets) >= 12  # CPU and overload reach minutes; GPUs live below 1 s
        assert 60.0 in buckets  # the old top bucket stays a boundary: rates across an upgrade line up


def test_classes_register_exactly_their_service() -> None:
    registry = CollectorRegistry()
    exposed: dict[str, set[str]] = {}
    for service, cls in m.METRICS_CLASSES.items():
        before = set(registry._names_to_collectors)
        cls(registry)
        exposed[service] = set(registry._names_to_collectors) - before
    for service in m.SERVICES:
        want = {s.name for s in m.SPECS if s.service == service}
        got = {n for n in exposed[service] if m.metric_of_series(n) == n}
        assert got == want, service


def test_each_metric_is_an_attribute_of_its_group() -> None:
    for service, cls in m.METRICS_CLASSES.items():
        group = cls(CollectorRegistry())
        names = [s.name for s in m.SPECS if s.service == service]
        assert len({m.ATTRIBUTES[n] for n in names}) == len(names), service  # no two share an attribute
        for name in names:
            assert getattr(group, m.ATTRIBUTES[name]) is group.by_name()[name]
    assert m.ATTRIBUTES[m.DECODE_TPOT_SECONDS] == "tpot_seconds"
    assert m.DecodeMetrics(CollectorRegistry()).tpot_seconds._upper_bounds[:-1] == list(m.TOKEN_BUCKETS)


def test_two_registries_do_not_collide() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    ra, rb = m.RouterMetrics(a), m.RouterMetrics(b)
    ra.ttft_seconds.labels(model="x").observe(0.1)
    assert a.get_sample_value(f"{m.ROUTER_TTFT_SECONDS}_count", {"model": "x"}) == 1
    assert b.get_sample_value(f"{m.ROUTER_TTFT_SECONDS}_count", {"model": "x"}) is None
    rb.requests_total.labels(model="x", status="ok", finish_reason="stop").inc()
    assert b.get_sample_value(m.ROUTER_REQUESTS_TOTAL, {"model": "x", "status": "ok",
                                                       "finish_reason": "stop"}) == 1
    with pytest.raises(ValueError):  # same registry twice is a programming error, not silently shared
        m.RouterMetrics(a)


def test_series_names_round_trip() -> None:
    for spec in m.SPECS:
        for series in m.series_names(spec.name):
            assert m.metric_of_series(series) == spec.name
    assert m.metric_of_series("pdserve_prefill_chunks_total_bucket") is None
    assert m.metric_of_series("pdserve_nope") is None


def test_metrics_server_port_zero_serves_registry() -> None:
    registry = CollectorRegistry()
    decode = m.DecodeMetrics(registry)
    decode.kv_wait_seconds.labels(model="tiny").observe(0.25)
    decode.kv_received_bytes_total.labels(transport="grpc").inc(4096)
    port = m.start_metrics_server(registry, "127.0.0.1", 0)
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        m.stop_metrics_server(port)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families[m.DECODE_KV_WAIT_SECONDS].type == "histogram"
    received = families[m.DECODE_KV_RECEIVED_BYTES_TOTAL.removesuffix("_total")]
    assert any(s.name == m.DECODE_KV_RECEIVED_BYTES_TOTAL and s.value == 4096 for s in received.samples)
    body, content_type = m.render_metrics(registry)
    assert b"pdserve_decode_kv_wait_seconds_bucket" in body and content_type.startswith("text/plain")


def _doc_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`pdserve_[a-z0-9_]+`", cells[0]):
            rows[cells[0].strip("`")] = cells
    return rows


def test_metrics_doc_matches_module() -> None:
    rows = _doc_rows()
    assert set(rows) == set(m.ALL_METRIC_NAMES), (
        f"missing from docs/METRICS.md: {sorted(m.ALL_METRIC_NAMES - set(rows))}; "
        f"not in metrics.py: {sorted(set(rows) - m.ALL_METRIC_NAMES)}")
    for name, (_, kind, labels, service, what) in rows.items():
        spec = m.SPECS_BY_NAME[name]
        assert kind == spec.kind, name
        assert tuple(x.strip() for x in labels.split(",") if x.strip()) == spec.labels, name
        assert service == spec.service, name
        assert what, name


def test_metrics_doc_mentions_no_unknown_names() -> None:
    mentioned = set(re.findall(r"pdserve_[a-z0-9_]+", DOC.read_text()))
    unknown = {n for n in mentioned if m.metric_of_series(n) is None}
    # Short forms in prose (e.g. `router_prompt_tokens_total`) are not matched by the pdserve_ prefix.
    assert not unknown, f"docs/METRICS.md names metrics metrics.py does not define: {sorted(unknown)}"


def test_initialise_creates_known_series_at_zero_and_skips_open_labels() -> None:
    registry = CollectorRegistry()
    router = m.RouterMetrics(registry)
    created = ms.initialise(router, model=("smol",), role=("prefill", "decode"))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for fam in registry.collect() for s in fam.samples}
    assert samples[(m.ROUTER_REQUESTS_TOTAL, (("finish_reason", "stop"), ("model", "smol"), ("status", "ok")))] == 0
    assert samples[(m.ROUTER_REQUESTS_TOTAL,
                    (("finish_reason", "cancelled"), ("model", "smol"), ("status", "cancelled")))] == 0
    assert not any(n == m.ROUTER_REQUESTS_TOTAL and dict(lbl).get("status") == "ok"
                   and dict(lbl).get("finish_reason") == "error" for n, lbl in samples)  # only real combinations
    for code in ms.ROUTER_ERROR_CODES:
        assert samples[(m.ROUTER_ERRORS_TOTAL, (("code", code), ("model", "smol")))] == 0
    assert samples[(m.ROUTER_TTFT_SECONDS + "_count", (("model", "smol"),))] == 0
    assert samples[(m.ROUTER_DISPATCH_RETRIES_TOTAL, (("reason", "overloaded"), ("role", "decode")))] == 0
    assert not any(n == m.ROUTER_INSTANCE_HEALTHY for n, _ in samples)  # endpoint: known only at run time
    # 4 outcomes + 9 codes + 6 reasons x 2 roles + 2 migration outcomes + 2 restart-wait outcomes x 2 roles +
    # the model's 3 timers, 2 token counters and in-flight gauge.
    assert created == 4 + len(ms.ROUTER_ERROR_CODES) + 12 + 2 + 4 + 6
    kv = m.KVStoreMetrics(CollectorRegistry())
    assert ms.initialise(kv) == len(ms.KNOWN_SERIES[m.KVSTORE_PUT_REFUSED_TOTAL][0]["reason"])  # no tier given
