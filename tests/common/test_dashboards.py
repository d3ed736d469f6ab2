"""Grafana dashboards (deploy/grafana/): generated from metrics.py, filtered by namespace/instance, and every
panel query answers on a real Prometheus scraping all of pdserve's metrics."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from services.common import metrics as m
from tests.prom_harness import TEST_NAMESPACE, PrometheusHarness, require_prometheus

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"

# Grafana's built-in and template variables, as Grafana would substitute them for one instance of everything.
VARIABLES = {
    "$__rate_interval": "15s",
    "$__interval": "5s",
    "$__range": "5m",
    "$namespace": TEST_NAMESPACE,
    "$instance": ".*",
}


def _load_builder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("build_dashboards", GRAFANA / "build_dashboards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


builder = _load_builder()


def _dashboards() -> dict[str, dict[str, Any]]:
    return {d.filename: json.loads((GRAFANA / d.filename).read_text()) for d in builder.DASHBOARDS}


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def _exprs() -> list[tuple[str, str]]:
    """(dashboard / panel / refId, expr) of every query in the committed JSON."""
    out = []
    for filename, dashboard in _dashboards().items():
        for panel in _panels(dashboard):
            for target in panel["targets"]:
                out.append((f"{filename} / {panel['title']} / {target['refId']}", target["expr"]))
    return out


SPEC_PANEL = "Speculative decoding: acceptance"
"""A panel with data only where decodes speculate: tests/e2e/test_spec_pd.py checks it against such a cluster."""


def panel_failures(prom: Any, exprs: list[tuple[str, str]]) -> list[str]:
    """Each (where, expr) evaluated by a live Prometheus (a tests.prom_harness.PrometheusHarness): what gave
    no data or only NaN/Inf. Grafana sizes $__rate_interval from the time range; 1m spans a test's traffic."""
    failures = []
    for where, expr in exprs:
        q = _substitute(expr.replace("$__rate_interval", "1m"))
        result = prom.query(q)
        values = [float(r["value"][1]) for r in result]
        if not result:
            failures.append(f"{where}: no data for {q}")
        elif not any(math.isfinite(v) for v in values):
            failures.append(f"{where}: only NaN/Inf ({values}) for {q}")
    return failures


def _substitute(expr: str) -> str:
    # Longest names first so `$__rate_interval` is not eaten by a shorter variable.
    for var in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(var, VARIABLES[var])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


# --- static checks --------------------------------------------------------------------------------

def test_committed_outputs_match_generator() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in builder.outputs().items()
             if not p.exists() or p.read_text() != text]
    assert not stale, f"run python deploy/grafana/build_dashboards.py; stale: {stale}"


def test_every_query_names_only_exported_metrics() -> None:
    used: set[str] = set()
    for where, expr in _exprs():
        series = re.findall(r"\bpdserve_[a-z0-9_]+", expr)
        assert series, f"{where}: no pdserve metric in {expr}"
        for s in series:
            name = m.metric_of_series(s)
            assert name is not None, f"{where}: {s} is not exported by any service (services/common/metrics.py)"
            used.add(name)
    # Not a requirement that every metric has a panel, but the dashboards should cover the timers.
    for timer in (s.name for s in m.SPECS if s.kind == "histogram"):
        assert timer in used, f"no panel shows {timer}"


def test_every_selector_is_filtered_by_namespace_and_instance() -> None:
    for where, expr in _exprs():
        for match in re.finditer(r"\b(pdserve_[a-z0-9_]+)(\{[^}]*\})?", expr):
            matchers = match.group(2) or ""
            assert 'namespace=~"$namespace"' in matchers and 'instance=~"$instance"' in matchers, (
                f"{where}: {match.group(0)} lacks the namespace/instance filter")


def test_templating_and_datasource() -> None:
    for filename, dashboard in _dashboards().items():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert set(variables) == {"datasource", "namespace", "instance"}, filename
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        for name in ("namespace", "instance"):
            assert variables[name]["type"] == "query"
            assert variables[name]["query"]["query"].startswith("label_values(")
            assert variables[name]["allValue"] == ".*"
        assert 'namespace=~"$namespace"' in variables["instance"]["query"]["query"]
        assert "namespace" not in json.dumps(variables["namespace"]["current"])  # no hard-coded namespace
        for panel in _panels(dashboard):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}"
        ids = [p["id"] for p in dashboard["panels"]]
        assert len(ids) == len(set(ids)), filename


def test_configmap_carries_both_dashboards() -> None:
    yaml = pytest.importorskip("yaml")
    cm = yaml.safe_load((GRAFANA / "dashboards-configmap.yaml").read_text())
    assert cm["kind"] == "ConfigMap"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {k: json.loads(v) for k, v in cm["data"].items()} == _dashboards()


def test_table_lists_every_query() -> None:
    table = (GRAFANA / "DASHBOARD_METRICS.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`pdserve_" in line]
    assert len(rows) == len(_exprs())


# --- against a real Prometheus --------------------------------------------------------------------

_LABEL_VALUES: dict[str, list[str]] = {
    "model": ["tiny"],
    "status": ["ok", "error"],
    "finish_reason": ["stop", "length"],
    "code": ["UNAVAILABLE"],
    "role": ["prefill", "decode"],
    "endpoint": ["10.0.0.7:50051"],
    "reason": ["timeout"],
    "source": ["local", "kvstore"],
    "transport": ["grpc", "mooncake"],
    "tier": ["memory", "disk"],
    "outcome": ["ok", "failed"],
    "cuda_graph": ["graphed", "eager"],
    "dtype": ["bfloat16"],
    "dtype_reason": ["cpu_amx_bf16"],
    "device": ["cpu"],
    "cpu_model": ["Xeon"],
    "cpu_threads": ["2"],
    "weight_format": ["int4"],
    "weight_format_reason": ["measured_faster"],
    "acceptance": ["real", "synthetic"],
    "rank": ["0", "1"],
    "phase": ["reserve", "claim", "import"],
}


def _children(metric: MetricWrapperBase, labels: tuple[str, ...]) -> Iterator[Any]:
    if not labels:
        yield metric
        return
    combos: list[dict[str, str]] = [{}]
    for label in labels:
        combos = [{**c, label: v} for c in combos for v in _LABEL_VALUES[label]]
    for combo in combos:
        yield metric.labels(**combo)


def _observe_everything(groups: list[m.MetricGroup], step: int) -> None:
    """Put a value into every series of every metric; later steps grow counters and histograms."""
    for group in groups:
        for name, metric in group.by_name().items():
            spec = m.SPECS_BY_NAME[name]
            for child in _children(metric, spec.labels):
                if isinstance(metric, Histogram):
                    for v in (0.003, 0.04, 0.4 * step):
                        child.observe(v)
                elif isinstance(metric, Counter):
                    child.inc(10 * step)
                elif isinstance(metric, Gauge):
                    child.set(0.25 * step)
                else:
                    raise AssertionError(f"unexpected metric type for {name}")


@pytest.fixture(scope="module")
def prometheus() -> Iterator[PrometheusHarness]:
    require_prometheus()
    registry = CollectorRegistry()
    groups = [cls(registry) for cls in m.METRICS_CLASSES.values()]
    _observe_everything(groups, 1)
    port = m.start_metrics_server(registry, "127.0.0.1", 0)
    try:
        with PrometheusHarness([f"127.0.0.1:{port}"]) as prom:
            prom.wait_for_scrapes(2)
            _observe_everything(groups, 2)  # counters move between scrapes, so rates are non-zero
            prom.wait_for_scrapes(4)
            yield prom
    finally:
        m.stop_metrics_server(port)


def test_every_panel_query_returns_data(prometheus: PrometheusHarness) -> None:
    """On the real exporters' series (tests/common/test_dashboard_values.py checks the numbers)."""
    failures = []
    for where, expr in _exprs():
        result = prometheus.query(_substitute(expr))
        values = [float(r["value"][1]) for r in result]
        if not result:
            failures.append(f"{where}: empty result for {expr}")
        elif not any(math.isfinite(v) for v in values):
            failures.append(f"{where}: only NaN/Inf ({values}) for {expr}")
    assert not failures, "\n".join(failures)


def test_variable_queries_find_the_target(prometheus: PrometheusHarness) -> None:
    for dashboard in _dashboards().values():
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        for name, label in (("namespace", "namespace"), ("instance", "instance")):
            query = variables[name]["query"]["query"]
            selector = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
            assert selector is not None and selector.group(2) == label, query
            series = prometheus.api("series", {"match[]": _substitute(selector.group(1))})
            values = {s[label] for s in series}
            if name == "namespace":
                assert values == {TEST_NAMESPACE}
            else:
                assert len(values) == 1 and next(iter(values)).startswith("127.0.0.1:")


def test_filter_excludes_other_namespaces(prometheus: PrometheusHarness) -> None:
    expr = builder.sum_rate(m.ROUTER_REQUESTS_TOTAL).replace("$namespace", "elsewhere")
    assert prometheus.query(_substitute(expr)) == []


# --- deploy/prometheus ----------------------------------------------------------------------------

PROM_DIR = ROOT / "deploy" / "prometheus"


def test_prometheus_configs_are_valid() -> None:
    yaml = pytest.importorskip("yaml")
    promtool = shutil.which("promtool")
    for name in ("prometheus.yml", "prometheus-local.yml"):
        config = yaml.safe_load((PROM_DIR / name).read_text())
        (job,) = config["scrape_configs"]
        assert job["job_name"] == "pdserve"
        if promtool is None:
            continue
        proc = subprocess.run([promtool, "check", "config", str(PROM_DIR / name)], capture_output=True,
                              text=True, timeout=30)
        # Debian's Prometheus is built without Kubernetes service discovery; the rest still gets checked.
        if "field kubernetes_sd_configs not found" in proc.stdout + proc.stderr:
            continue
        assert proc.returncode == 0, proc.stdout + proc.stderr
    k8s = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())["scrape_configs"][0]
    targets = {r.get("target_label") for r in k8s["relabel_configs"]}
    assert {"namespace", "__address__"} <= targets
    monitor = yaml.safe_load((PROM_DIR / "podmonitor.yaml").read_text())
    assert monitor["kind"] == "PodMonitor" and monitor["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
