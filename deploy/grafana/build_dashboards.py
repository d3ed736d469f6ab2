"""Generate pdserve's Grafana dashboards, their ConfigMap and the panel | metric | formula table.

Dashboards are code: metric names come from services/common/metrics.py, every query
is filtered by the `namespace` and `instance` template variables, and the datasource is a variable.

    python deploy/grafana/build_dashboards.py           # rewrite the committed outputs
    python deploy/grafana/build_dashboards.py --check   # exit 1 if they differ from this script's output

Outputs (next to this file): pdserve-overview.json, pdserve-pd.json, dashboards-configmap.yaml,
DASHBOARD_METRICS.md. tests/common/test_dashboards.py runs every query against a real Prometheus.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.common import metrics as m  # noqa: E402

FILTER = 'namespace=~"$namespace", instance=~"$instance"'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}
CONFIGMAP_NAME = "pdserve-grafana-dashboards"
# One series every pdserve service exports as soon as it runs: feeds the namespace/instance pickers.
PRESENCE_METRICS = (m.ROUTER_INSTANCE_HEALTHY, m.PREFILL_RUNNING_REQUESTS, m.DECODE_RUNNING_REQUESTS,
                    m.KVSTORE_ENTRIES)
PRESENCE_SELECTOR = '{__name__=~"' + "|".join(PRESENCE_METRICS) + '"}'


# --- PromQL helpers ------------------------------------------------------------------------------

def sel(name: str, extra: str = "") -> str:
    """`name{namespace=~"$namespace", instance=~"$instance"[, extra]}`."""
    return f"{name}{{{FILTER}{', ' + extra if extra else ''}}}"


def rate(name: str, extra: str = "") -> str:
    return f"rate({sel(name, extra)}[{RATE}])"


def sum_rate(name: str, by: str = "", extra: str = "") -> str:
    return f"sum{f' by ({by})' if by else ''} ({rate(name, extra)})"


def or_zero(expr: str) -> str:
    """``expr``, or a single 0 when it has no series (a counter that has not fired yet): the panel shows
    0, not "no data". ``or on()`` adds the 0 only when ``expr`` is empty. The whole is parenthesised: `or`
    binds looser than arithmetic, so ``or_zero(a) / b`` would otherwise divide only the 0 by b."""
    return f"(({expr}) or on() vector(0))"


GRAPHED = 'cuda_graph="graphed"'
"""Label matcher of CUDA-graphed engine steps."""


def quantile(q: float, hist: str, by: str = "") -> str:
    assert m.SPECS_BY_NAME[hist].kind == "histogram", hist
    group = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, sum by ({group}) ({rate(hist + '_bucket')}))"


@dataclass
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    targets: list[Target]
    unit: str = "short"
    description: str = ""
    width: int = 8
    max: float | None = None


@dataclass
class Row:
    title: str
    panels: list[Panel] = field(default_factory=list)


def p50_p99(hist: str, label: str = "") -> list[Target]:
    prefix = f"{label} " if label else ""
    return [Target(quantile(0.5, hist), f"{prefix}p50"), Target(quantile(0.99, hist), f"{prefix}p99")]


def latency(title: str, hist: str) -> Panel:
    """p50 and p99 of histogram ``hist`` (seconds), described by its metric's help text."""
    return Panel(title, p50_p99(hist), unit="s", description=m.SPECS_BY_NAME[hist].help)


# --- dashboards ----------------------------------------------------------------------------------

def overview_rows() -> list[Row]:
    return [
        Row("Traffic", [
            Panel("Request rate by status", [Target(sum_rate(m.ROUTER_REQUESTS_TOTAL, "status"), "{{status}}")],
                  unit="reqps", description="Finished client requests per second at the router."),
            Panel("Error rate", [Target(
                # `/` binds tighter than `or`: the zero-filled numerator needs its own parentheses.
                f"{or_zero(f'sum ({rate(m.ROUTER_ERRORS_TOTAL)})')} / sum ({rate(m.ROUTER_REQUESTS_TOTAL)})",
                "errors / requests")],
                  unit="percentunit", description="Share of client requests that failed."),
            Panel("Errors by code", [Target(or_zero(sum_rate(m.ROUTER_ERRORS_TOTAL, "code")), "{{code}}")],
                  unit="reqps"),
            Panel("Tokens/s in and out", [
                Target(sum_rate(m.ROUTER_PROMPT_TOKENS_TOTAL), "in (prompt)"),
                Target(sum_rate(m.ROUTER_GENERATION_TOKENS_TOTAL), "out (generated)"),
            ], unit="tok/s"),
            Panel("Finish reasons", [Target(sum_rate(m.ROUTER_REQUESTS_TOTAL, "finish_reason", 'status="ok"'),
                                            "{{finish_reason}}")], unit="reqps"),
            Panel("In-flight requests", [Target(f"sum by (instance) ({sel(m.ROUTER_INFLIGHT_REQUESTS)})",
                                                "{{instance}}")]),
        ]),
        Row("Client latency", [
            latency("Client TTFT", m.ROUTER_TTFT_SECONDS),
            latency("Inter-token latency (ITL)", m.ROUTER_ITL_SECONDS),
            latency("End-to-end latency", m.ROUTER_E2E_SECONDS),
        ]),
        Row("Backends", [
            Panel("Healthy backends by role", [Target(f"sum by (role) ({sel(m.ROUTER_INSTANCE_HEALTHY)})",
                                                      "{{role}}")], width=12,
                  description="Prefill/decode/kvstore instances the router sees as SERVING."),
            Panel("Dispatch retries", [Target(or_zero(sum_rate(m.ROUTER_DISPATCH_RETRIES_TOTAL, "role, reason")),
                                              "{{role}} {{reason}}")], unit="ops", width=12),
        ]),
    ]


def pd_rows() -> list[Row]:
    kv_wait_doc = ("Decode KV-wait runs from the decode reservation to the last KV chunk landing, so under "
                   "parallel dispatch it contains prefill queue and compute: it is NOT the transfer time. "
                   "Exposed transfer (prefill's last chunk computed -> last chunk landed) is the part of "
                   "the transfer that chunked overlap did not hide.")
    triple = [(m.DECODE_KV_WAIT_SECONDS, "decode KV-wait"),
              (m.DECODE_KV_TRANSFER_EXPOSED_SECONDS, "exposed KV transfer"),
              (m.PREFILL_COMPUTE_SECONDS, "prefill compute")]
    return [
        Row("Where TTFT goes", [
            Panel("KV-wait vs exposed transfer vs prefill compute (p50)",
                  [Target(quantile(0.5, h), label) for h, label in triple], unit="s", width=12,
                  description=kv_wait_doc),
            Panel("KV-wait vs exposed transfer vs prefill compute (p99)",
                  [Target(quantile(0.99, h), label) for h, label in triple], unit="s", width=12,
                  description=kv_wait_doc),
            latency("Prefill queue", m.PREFILL_QUEUE_SECONDS),
            latency("Decode queue", m.DECODE_QUEUE_SECONDS),
            latency("TPOT", m.DECODE_TPOT_SECONDS),
            Panel("Exposed transfer share of KV-wait (mean)", [Target(
                f"sum ({rate(m.DECODE_KV_TRANSFER_EXPOSED_SECONDS + '_sum')}) / "
                f"sum ({rate(m.DECODE_KV_WAIT_SECONDS + '_sum')})", "exposed / KV-wait")],
                  unit="percentunit", width=12,
                  description="Near 0: transfer hidden behind prefill compute. Near 1: decode waits on bytes."),
            Panel("Prefill compute (p50/p99)", p50_p99(m.PREFILL_COMPUTE_SECONDS), unit="s", width=12,
                  description="First chunk scheduled -> last chunk computed."),
            Panel("Handoff phases (mean)", [
                Target(f"sum by (phase) ({rate(h + '_sum')}) / sum by (phase) ({rate(h + '_count')})",
                       f"{svc} {{{{phase}}}}")
                for h, svc in ((m.ROUTER_HANDOFF_PHASE_SECONDS, "router"), (m.PREFILL_HANDOFF_PHASE_SECONDS, "prefill"),
                               (m.DECODE_HANDOFF_PHASE_SECONDS, "decode"))], unit="s", width=24,
                  description="Router: arrival -> each point of the handoff. Prefill and decode: their own phases "
                              "(docs/METRICS.md). benchmarks/pd_plumbing.py lines them up for one request."),
        ]),
        Row("KV transfer", [
            Panel("KV bytes/s by transport", [
                Target(sum_rate(m.PREFILL_KV_SENT_BYTES_TOTAL, "transport"), "sent {{transport}}"),
                Target(sum_rate(m.DECODE_KV_RECEIVED_BYTES_TOTAL, "transport"), "received {{transport}}"),
            ], unit="Bps"),
            Panel("KV chunks/s by transport", [
                Target(sum_rate(m.PREFILL_KV_CHUNKS_SENT_TOTAL, "transport"), "sent {{transport}}"),
                Target(sum_rate(m.DECODE_KV_CHUNKS_RECEIVED_TOTAL, "transport"), "received {{transport}}"),
            ], unit="ops"),
            Panel("Transfer failures", [
                Target(or_zero(sum_rate(m.PREFILL_KV_TRANSFER_FAILURES_TOTAL, "transport, reason")),
                       "prefill {{transport}} {{reason}}"),
                Target(or_zero(sum_rate(m.DECODE_KV_CHUNKS_REJECTED_TOTAL, "reason")), "decode rejected {{reason}}"),
                Target(or_zero(sum_rate(m.DECODE_RESERVATIONS_EXPIRED_TOTAL)), "reservations expired"),
            ], unit="ops"),
        ]),
        Row("Capacity", [
            Panel("Decode KV cache usage", [Target(f"max by (instance) ({sel(m.DECODE_KV_CACHE_USAGE_RATIO)})",
                                                   "{{instance}}")], unit="percentunit", max=1.0),
            Panel("Prefill running / waiting", [
                Target(f"sum ({sel(m.PREFILL_RUNNING_REQUESTS)})", "running"),
                Target(f"sum ({sel(m.PREFILL_WAITING_REQUESTS)})", "waiting"),
            ]),
            Panel("Decode running / waiting / waiting for KV", [
                Target(f"sum ({sel(m.DECODE_RUNNING_REQUESTS)})", "running"),
                Target(f"sum ({sel(m.DECODE_WAITING_REQUESTS)})", "waiting"),
                Target(f"sum ({sel(m.DECODE_WAITING_FOR_KV_REQUESTS)})", "waiting for KV"),
            ]),
            Panel("Prefill throughput", [
                Target(sum_rate(m.PREFILL_COMPUTED_TOKENS_TOTAL), "computed tokens/s"),
                Target(sum_rate(m.PREFILL_CHUNKS_TOTAL), "chunks/s"),
            ], width=12),
            Panel("Decode tokens/s", [Target(sum_rate(m.DECODE_GENERATION_TOKENS_TOTAL), "generated")],
                  unit="tok/s", width=12),
            Panel("Speculative decoding: acceptance", [
                Target(f"sum by (acceptance) ({rate(m.DECODE_SPEC_ACCEPTED_TOKENS_TOTAL)}) / "
                       f"sum by (acceptance) ({rate(m.DECODE_SPEC_DRAFT_TOKENS_TOTAL)})", "accepted/proposed {{acceptance}}"),
                Target(f"sum by (acceptance) ({rate(m.DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS + '_sum')}) / "
                       f"sum by (acceptance) ({rate(m.DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS + '_count')})",
                       "tokens/step {{acceptance}}"),
            ], width=12, description="Draft tokens accepted per proposed, and tokens per verify step (accepted + 1). "
                                     "acceptance=synthetic marks benchmark runs whose acceptance was forced."),
        ]),
        Row("Engine steps", [
            Panel("Step duration (p50/p99)", [
                *p50_p99(m.PREFILL_ENGINE_STEP_SECONDS, "prefill"), *p50_p99(m.DECODE_ENGINE_STEP_SECONDS, "decode")],
                  unit="s", description=m.SPECS_BY_NAME[m.DECODE_ENGINE_STEP_SECONDS].help),
            Panel("Tokens and sequences per step (mean)", [
                Target(f"sum ({rate(h + '_sum')}) / sum ({rate(h + '_count')})", label)
                for h, label in ((m.PREFILL_ENGINE_STEP_TOKENS, "prefill tokens"),
                                 (m.PREFILL_ENGINE_STEP_SEQUENCES, "prefill sequences"),
                                 (m.DECODE_ENGINE_STEP_TOKENS, "decode tokens"),
                                 (m.DECODE_ENGINE_STEP_SEQUENCES, "decode sequences"))],
                  description="Tokens one step ran through the model and the sequences (rows) it held."),
            Panel("Engine busy ratio and CUDA-graphed steps", [
                Target(f"max by (instance) ({sel(m.PREFILL_ENGINE_BUSY_RATIO)})", "prefill busy {{instance}}"),
                Target(f"max by (instance) ({sel(m.DECODE_ENGINE_BUSY_RATIO)})", "decode busy {{instance}}"),
                Target(f"sum ({rate(m.PREFILL_ENGINE_BUSY_SECONDS_TOTAL)}) / count ({sel(m.PREFILL_ENGINE_BUSY_RATIO)})",
                       "prefill busy (rate, mean)"),
                Target(f"sum ({rate(m.DECODE_ENGINE_BUSY_SECONDS_TOTAL)}) / count ({sel(m.DECODE_ENGINE_BUSY_RATIO)})",
                       "decode busy (rate, mean)"),
                Target(f"{or_zero(sum_rate(m.DECODE_ENGINE_STEPS_TOTAL, '', GRAPHED))} / "
                       f"sum ({rate(m.DECODE_ENGINE_STEPS_TOTAL)})", "decode graphed share"),
                Target(f"{or_zero(sum_rate(m.PREFILL_ENGINE_STEPS_TOTAL, '', GRAPHED))} / "
                       f"sum ({rate(m.PREFILL_ENGINE_STEPS_TOTAL)})", "prefill graphed share"),
            ], unit="percentunit", max=1.0,
                  description="Busy: share of wall time the engine thread spent stepping (near 1: the step loop is "
                              "the limit, not the serving layer). Graphed share: steps replayed in a CUDA graph."),
        ]),
        Row("Prefix cache and kvstore", [
            Panel("Cached-prefix tokens skipped/s by source", [
                Target(sum_rate(m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, "source"), "{{source}}"),
                Target(sum_rate(m.PREFILL_KV_SKIPPED_TOKENS_TOTAL), "not sent (decode held them)")], unit="tok/s",
                  description="Computed + cached (local, kvstore) = prompt tokens. Tokens decode already held "
                              "are computed by prefill all the same; only their transfer is skipped."),
            Panel("Prefix hit ratio", [Target(
                f"sum ({rate(m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL)}) / (sum ({rate(m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL)})"
                f" + sum ({rate(m.PREFILL_COMPUTED_TOKENS_TOTAL)}))", "skipped / prompt tokens")],
                  unit="percentunit", description="Share of prompt tokens prefill did not compute."),
            Panel("kvstore hit rate per tier", [Target(
                f"{sum_rate(m.KVSTORE_HITS_TOTAL, 'tier')} / ({sum_rate(m.KVSTORE_HITS_TOTAL, 'tier')}"
                f" + {sum_rate(m.KVSTORE_MISSES_TOTAL, 'tier')})", "{{tier}}")], unit="percentunit"),
            Panel("kvstore evictions and corrupt pages", [
                Target(or_zero(sum_rate(m.KVSTORE_EVICTIONS_TOTAL, "tier")), "evicted {{tier}}"),
                Target(or_zero(sum_rate(m.KVSTORE_CORRUPT_TOTAL, "tier")), "corrupt {{tier}}"),
            ], unit="ops"),
            Panel("kvstore stored bytes per tier", [
                Target(f"sum by (tier) ({sel(m.KVSTORE_STORED_BYTES)})", "{{tier}}")], unit="bytes"),
            Panel("kvstore entries per tier and Get/Put bytes/s", [
                Target(f"sum by (tier) ({sel(m.KVSTORE_ENTRIES)})", "entries {{tier}}"),
                Target(sum_rate(m.KVSTORE_GET_BYTES_TOTAL), "get B/s"),
                Target(sum_rate(m.KVSTORE_PUT_BYTES_TOTAL), "put B/s"),
            ]),
        ]),
    ]


@dataclass
class Dashboard:
    uid: str
    title: str
    filename: str
    description: str
    rows: list[Row]


DASHBOARDS: tuple[Dashboard, ...] = (
    Dashboard("pdserve-overview", "pdserve / Overview", "pdserve-overview.json",
              "Client-facing view at the router: traffic, TTFT, ITL, end-to-end latency, tokens, errors.",
              overview_rows()),
    Dashboard("pdserve-pd", "pdserve / Prefill-Decode", "pdserve-pd.json",
              "Where TTFT goes between prefill and decode: queues, compute, KV-wait vs exposed transfer, "
              "KV bytes, cache pressure, prefix reuse and kvstore tiers.",
              pd_rows()),
)


# --- Grafana JSON model --------------------------------------------------------------------------

def _variable(name: str, label: str, label_name: str, selector: str) -> dict[str, Any]:
    query = f"label_values({selector}, {label_name})"
    return {
        "allValue": ".*",
        "current": {},
        "datasource": DS,
        "definition": query,
        "hide": 0,
        "includeAll": True,
        "label": label,
        "multi": True,
        "name": name,
        "options": [],
        "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


def templating() -> dict[str, Any]:
    namespaced = PRESENCE_SELECTOR[:-1] + ', namespace=~"$namespace"}'
    return {"list": [
        {"current": {}, "hide": 0, "includeAll": False, "label": "Data source", "multi": False,
         "name": "datasource", "options": [], "query": "prometheus", "refresh": 1, "regex": "",
         "skipUrlSync": False, "type": "datasource"},
        _variable("namespace", "Namespace", "namespace", PRESENCE_SELECTOR),
        _variable("instance", "Instance", "instance", namespaced),
    ]}


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "color": {"mode": "palette-classic"},
        "custom": {"drawStyle": "line", "fillOpacity": 10, "lineWidth": 1, "showPoints": "never",
                   "spanNulls": False},
        "min": 0,
        "unit": panel.unit,
    }
    if panel.max is not None:
        defaults["max"] = panel.max
    return {
        "datasource": DS,
        "description": panel.description,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "id": pid,
        "options": {"legend": {"calcs": [], "displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [{"datasource": DS, "editorMode": "code", "expr": t.expr, "legendFormat": t.legend,
                     "range": True, "refId": chr(ord("A") + i)} for i, t in enumerate(panel.targets)],
        "title": panel.title,
        "type": "timeseries",
    }


def dashboard_json(d: Dashboard) -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in d.rows:
        panels.append({"collapsed": False, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "id": pid,
                       "panels": [], "title": row.title, "type": "row"})
        pid, y, x = pid + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(panel, pid, x, y))
            pid, x = pid + 1, x + panel.width
        y += 8
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True,
            "hide": True, "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard",
        }]},
        "description": d.description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [{"asDropdown": False, "icon": "dashboard", "includeVars": True, "keepTime": True,
                   "tags": ["pdserve"], "title": "pdserve", "type": "dashboards"}],
        "panels": panels,
        "refresh": "30s",
        "schemaVersion": 39,
        "tags": ["pdserve"],
        "templating": templating(),
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": d.title,
        "uid": d.uid,
        "version": 1,
    }


# --- rendering -----------------------------------------------------------------------------------

_METRIC_RE = re.compile(r"\bpdserve_[a-z0-9_]+")


def metrics_in(expr: str) -> list[str]:
    """Metric names (per services/common/metrics.py) referenced by a PromQL expression, in order."""
    out: list[str] = []
    for series in _METRIC_RE.findall(expr):
        name = m.metric_of_series(series) or series
        if name not in out:
            out.append(name)
    return out


def render_json(d: Dashboard) -> str:
    return json.dumps(dashboard_json(d), indent=2) + "\n"


def render_configmap() -> str:
    lines = [
        "# Generated by deploy/grafana/build_dashboards.py; do not edit by hand.",
        "# Picked up by the Grafana dashboard sidecar (kube-prometheus-stack: sidecar.dashboards.enabled).",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {CONFIGMAP_NAME}",
        "  labels:",
        '    grafana_dashboard: "1"',
        "    app.kubernetes.io/part-of: pdserve",
        "  annotations:",
        "    grafana_folder: pdserve",
        "data:",
    ]
    for d in DASHBOARDS:
        lines.append(f"  {d.filename}: |")
        lines.extend(f"    {line}" if line else "" for line in render_json(d).splitlines())
    return "\n".join(lines) + "\n"


def render_table() -> str:
    out = [
        "# pdserve dashboards: panel | metric | formula",
        "",
        "Generated by `deploy/grafana/build_dashboards.py` from `services/common/metrics.py`; do not edit.",
        "Metric meanings: [docs/METRICS.md](../../docs/METRICS.md).",
        "",
        f"In formulas, `{{$sel}}` stands for `{{{FILTER}}}` (every query carries it) and `$__rate_interval` is "
        "Grafana's rate window. Template variables: `datasource` (Prometheus), `namespace`, `instance` "
        f"(`label_values({PRESENCE_SELECTOR}, ...)`).",
        "",
    ]
    for d in DASHBOARDS:
        out += [f"## {d.title} (`{d.filename}`, uid `{d.uid}`)", "", d.description, "",
                "| Panel | Metric | Formula |", "|---|---|---|"]
        for row in d.rows:
            for panel in row.panels:
                for t in panel.targets:
                    metric_cell = "<br>".join(f"`{name}`" for name in metrics_in(t.expr))
                    formula = t.expr.replace(f"{{{FILTER}}}", "{$sel}").replace(f"{{{FILTER}, ", "{$sel, ")
                    formula = formula.replace("|", "\\|")
                    title = f"{row.title} / {panel.title}" + (f" ({t.legend})" if len(panel.targets) > 1 else "")
                    out.append(f"| {title} | {metric_cell} | `{formula}` |")
        out.append("")
    return "\n".join(out)


def outputs() -> dict[Path, str]:
    files = {HERE / d.filename: render_json(d) for d in DASHBOARDS}
    files[HERE / "dashboards-configmap.yaml"] = render_configmap()
    files[HERE / "DASHBOARD_METRICS.md"] = render_table()
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed outputs are stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("stale (run python deploy/grafana/build_dashboards.py):", *stale, sep="\n  ")
        return 1
    print("wrote" if stale else "up to date", *stale, sep="\n  " if stale else " ")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
