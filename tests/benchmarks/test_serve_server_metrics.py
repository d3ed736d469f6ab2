"""Server-side figures from /metrics: window deltas and bucket quantiles (Prometheus semantics)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from benchmarks.serve.server_metrics import HistogramDelta, delta, expand_targets, histogram, parse, summarize
from services.common import metrics as m


def _page(ttfts: list[float], prompt_tokens: int) -> dict:
    reg = CollectorRegistry()
    h = Histogram(m.ROUTER_TTFT_SECONDS, "ttft", ["model"], registry=reg, buckets=m.LATENCY_BUCKETS)
    c = Counter(m.ROUTER_PROMPT_TOKENS_TOTAL.removesuffix("_total"), "in", ["model"], registry=reg)
    for v in ttfts:
        h.labels("x").observe(v)
    c.labels("x").inc(prompt_tokens)
    return parse(generate_latest(reg).decode())


def test_window_delta_excludes_what_came_before():
    before = {"router:1": _page([5.0, 5.0], 100)}
    after = {"router:1": _page([5.0, 5.0, 0.12, 0.18, 0.22, 0.4], 340)}
    d = delta(before, after)
    h = histogram(d, m.ROUTER_TTFT_SECONDS)
    assert h.count == 4 and h.sum == pytest.approx(0.92)
    s = summarize(d)
    assert s["counters"]["router_prompt_tokens"] == 240
    assert s["histograms"]["router_ttft"]["mean"] == pytest.approx(0.23)
    assert "decode_kv_wait" not in s["histograms"]  # nothing observed: left out


def test_a_restarted_service_counts_from_zero():
    before = {"a": _page([1.0] * 5, 500)}
    after = {"a": _page([0.2], 40)}  # counters went down: the process restarted in the window
    s = summarize(delta(before, after))
    assert s["counters"]["router_prompt_tokens"] == 40
    assert s["histograms"]["router_ttft"]["count"] == 1


def test_bucket_quantile_is_prometheus_histogram_quantile():
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.2], 2 in (0.2, 0.5].
    h = HistogramDelta(10, 1.5, ((0.1, 4), (0.2, 8), (0.5, 10), (float("inf"), 10)))
    assert h.quantile(0.5) == pytest.approx(0.1 + 0.1 * (5 - 4) / 4)
    assert h.quantile(0.4) == pytest.approx(0.1)
    assert h.quantile(0.9) == pytest.approx(0.2 + 0.3 * (9 - 8) / 2)
    over = HistogramDelta(2, 200.0, ((60.0, 0), (float("inf"), 2)))
    assert over.quantile(0.5) == 60.0  # in the overflow bucket: the highest finite bound
    assert HistogramDelta(0, 0, ()).quantile(0.5) is None


def test_sums_over_endpoints_and_labels():
    a, b = _page([0.1], 10), _page([0.3, 0.3], 20)
    s = summarize(delta({}, {"p:1": a, "p:2": b}))
    assert s["histograms"]["router_ttft"]["count"] == 3
    assert s["counters"]["router_prompt_tokens"] == 30


def test_targets_from_a_prometheus_file_sd_list(tmp_path):
    f = tmp_path / "targets.json"
    f.write_text('[{"targets": ["127.0.0.1:9100", "127.0.0.1:9101"], "labels": {"namespace": "local"}}]')
    assert expand_targets(["10.0.0.1:9000", str(f)]) == ["10.0.0.1:9000", "127.0.0.1:9100", "127.0.0.1:9101"]
    f.write_text('{"targets": []}')
    with pytest.raises(ValueError, match="list"):
        expand_targets([str(f)])
