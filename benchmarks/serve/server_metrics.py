"""pdserve's own timers and counters over the benchmark's window, from each service's ``/metrics``.

Every given endpoint is scraped as the measured window opens and again as it closes; a histogram's
or counter's figure is the difference (summed over endpoints and label sets), so it covers the same
requests as the client's numbers, warmup excluded. Histogram quantiles are interpolated within
buckets the way Prometheus' ``histogram_quantile`` does, so they are only as fine as the buckets
(services/common/metrics.py: LATENCY_BUCKETS, TOKEN_BUCKETS); the mean (sum / count) is exact.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics as m

HISTOGRAMS = {
    "router_ttft": m.ROUTER_TTFT_SECONDS,
    "router_itl": m.ROUTER_ITL_SECONDS,
    "router_e2e": m.ROUTER_E2E_SECONDS,
    "prefill_queue": m.PREFILL_QUEUE_SECONDS,
    "prefill_compute": m.PREFILL_COMPUTE_SECONDS,
    "decode_kv_wait": m.DECODE_KV_WAIT_SECONDS,
    "decode_kv_transfer_exposed": m.DECODE_KV_TRANSFER_EXPOSED_SECONDS,
    "decode_queue": m.DECODE_QUEUE_SECONDS,
    "decode_tpot": m.DECODE_TPOT_SECONDS,
}
"""Report key -> histogram name (docs/METRICS.md says what each measures)."""

COUNTERS = {
    "router_prompt_tokens": (m.ROUTER_PROMPT_TOKENS_TOTAL, None),
    "router_generation_tokens": (m.ROUTER_GENERATION_TOKENS_TOTAL, None),
    "router_requests_ok": (m.ROUTER_REQUESTS_TOTAL, ("status", "ok")),
    "router_requests_error": (m.ROUTER_REQUESTS_TOTAL, ("status", "error")),
    "prefill_computed_tokens": (m.PREFILL_COMPUTED_TOKENS_TOTAL, None),
    "prefill_cached_tokens_local": (m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, ("source", "local")),
    "prefill_cached_tokens_kvstore": (m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, ("source", "kvstore")),
    "prefill_cached_tokens_decode": (m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, ("source", "decode")),
    "prefill_kv_sent_bytes": (m.PREFILL_KV_SENT_BYTES_TOTAL, None),
    "decode_generation_tokens": (m.DECODE_GENERATION_TOKENS_TOTAL, None),
    "kvstore_hits": (m.KVSTORE_HITS_TOTAL, None),
    "kvstore_misses": (m.KVSTORE_MISSES_TOTAL, None),
}
"""Report key -> (counter sample name, optional (label, value) the sample must carry)."""

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> dict[Sample, float]:
    """Every sample of a Prometheus text page, keyed by (sample name, sorted labels)."""
    out: dict[Sample, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def expand_targets(entries: list[str]) -> list[str]:
    """host:port entries as given; an entry naming a .json file is a Prometheus file_sd target list
    (``[{"targets": ["host:port", ...], ...}]``, what ``pdserve up --prometheus-sd`` writes)."""
    out: list[str] = []
    for e in entries:
        if e.endswith(".json"):
            with open(e, encoding="utf-8") as f:
                groups = json.load(f)
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                raise ValueError(f"{e}: expected a list of {{'targets': [...]}} objects")
            out += [str(t) for g in groups for t in g.get("targets", [])]
        else:
            out.append(e)
    return out


def scrape(endpoints: list[str], timeout_s: float = 10.0) -> dict[str, dict[Sample, float]]:
    """host:port -> samples; an endpoint that does not answer maps to {} (reported, not fatal)."""
    out: dict[str, dict[Sample, float]] = {}
    for ep in endpoints:
        url = ep if ep.startswith("http") else f"http://{ep}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                out[ep] = parse(r.read().decode())
        except OSError:
            out[ep] = {}
    return out


def delta(before: dict[str, dict[Sample, float]], after: dict[str, dict[Sample, float]]) -> dict[Sample, float]:
    """after - before per sample, summed over endpoints; a sample that went down (the service
    restarted in the window) counts from zero."""
    out: dict[Sample, float] = defaultdict(float)
    for ep, samples in after.items():
        prev = before.get(ep, {})
        for key, v in samples.items():
            d = v - prev.get(key, 0.0)
            out[key] += v if d < 0 else d
    return dict(out)


@dataclass(frozen=True)
class HistogramDelta:
    count: float
    sum: float
    buckets: tuple[tuple[float, float], ...]
    """(upper bound ``le``, cumulative count), ascending, +Inf last."""

    def quantile(self, q: float) -> float | None:
        """Prometheus histogram_quantile: linear within the bucket holding rank q * count."""
        if self.count <= 0 or not self.buckets:
            return None
        rank = q * self.count
        lower, prev = 0.0, 0.0
        for le, cum in self.buckets:
            if cum >= rank:
                if math.isinf(le):
                    return lower  # in the overflow bucket: the highest finite bound
                if cum == prev:
                    return le
                return lower + (le - lower) * (rank - prev) / (cum - prev)
            lower, prev = le, cum
        return lower

    def summary(self) -> dict[str, float | None]:
        return {"count": self.count, "mean": self.sum / self.count if self.count else None,
                "p50": self.quantile(0.5), "p90": self.quantile(0.9), "p99": self.quantile(0.99)}


def histogram(d: dict[Sample, float], name: str) -> HistogramDelta:
    """One histogram of a delta, summed over label sets (e.g. every model label)."""
    buckets: dict[float, float] = defaultdict(float)
    count = total = 0.0
    for (sample, labels), v in d.items():
        if sample == name + "_bucket":
            buckets[float(dict(labels)["le"])] += v
        elif sample == name + "_count":
            count += v
        elif sample == name + "_sum":
            total += v
    return HistogramDelta(count, total, tuple(sorted(buckets.items())))


def counter(d: dict[Sample, float], name: str, match: tuple[str, str] | None = None) -> float:
    total = 0.0
    for (sample, labels), v in d.items():
        if sample == name and (match is None or dict(labels).get(match[0]) == match[1]):
            total += v
    return total


def summarize(d: dict[Sample, float]) -> dict[str, object]:
    """The report's server section: each histogram's count/mean/p50/p90/p99 and each counter."""
    hists = {key: histogram(d, name).summary() for key, name in HISTOGRAMS.items()}
    counters = {key: counter(d, name, match) for key, (name, match) in COUNTERS.items()}
    return {"histograms": {k: v for k, v in hists.items() if v["count"]},
            "counters": {k: v for k, v in counters.items() if v}}


class Window:
    """Scrapes ``endpoints`` as a window opens and closes; ``result()`` is the summary of the window."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.before: dict[str, dict[Sample, float]] = {}
        self.after: dict[str, dict[Sample, float]] = {}

    def __call__(self, edge: str) -> None:
        if edge == "start":
            self.before = scrape(self.endpoints)
        else:
            self.after = scrape(self.endpoints)

    def delta(self) -> dict[Sample, float]:
        return delta(self.before, self.after)

    def result(self) -> dict[str, object]:
        out = summarize(self.delta())
        missing = [ep for ep, s in {**self.before, **self.after}.items() if not s]
        if missing:
            out["unreachable"] = missing
        return out
