"""components/autoscaling and deploy/prometheus/prometheus-adapter-values.yaml: prefill and decode each scale
on their own signals (HPA autoscaling/v2 on per-pod custom metrics), every metric an HPA asks for is served by
an adapter rule, the targets fit the workers' configuration, and every rule's metricsQuery, expanded the way
prometheus-adapter expands it, gives the known per-pod value on a real Prometheus. The KEDA form
(components/autoscaling-keda) carries the same signals, targets and behaviour, and its queries give the
known values too."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common import metrics as m
from services.engine.config import EngineConfig
from tests.common.test_dashboard_values import _quantile, known  # noqa: F401  (known: the Prometheus fixture)
from tests.deploy.test_k8s_manifests import effective_config, render, workload_of
from tests.prom_harness import TEST_NAMESPACE, PrometheusHarness

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
ADAPTER_VALUES = REPO / "deploy" / "prometheus" / "prometheus-adapter-values.yaml"
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None,
                                   reason="kubectl not on PATH: `kubectl kustomize` is needed to render deploy/k8s")
AUTOSCALED = ("overlays/autoscaling", "overlays/gpu+mooncake+mooncake-kv+autoscaling")


def _rules() -> list[dict[str, Any]]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def _series_of(rule: dict[str, Any]) -> str:
    match = re.fullmatch(r"([a-z0-9_]+)\{[^}]*\}", rule["seriesQuery"])
    assert match, f"seriesQuery names one series: {rule['seriesQuery']}"
    return match.group(1)


def served_name(rule: dict[str, Any]) -> str:
    """The custom-metric name a rule serves (name.matches/as, like prometheus-adapter: default as ${1})."""
    series = _series_of(rule)
    name = rule.get("name", {})
    found = re.fullmatch(name.get("matches", "(.*)"), series)
    assert found, f"{series} does not match {name.get('matches')}"
    return re.sub(r"\$\{(\d+)\}", lambda g: found.group(int(g.group(1))), name.get("as", "${1}"))


def expand(rule: dict[str, Any], pods: list[str]) -> str:
    """metricsQuery with the template prometheus-adapter fills for a pods/<metric> request in one namespace."""
    matchers = f'namespace="{TEST_NAMESPACE}",pod=~"{"|".join(pods)}"'
    return (rule["metricsQuery"].replace("<<.Series>>", _series_of(rule))
            .replace("<<.LabelMatchers>>", matchers).replace("<<.GroupBy>>", "pod"))


# ---- the adapter rules ---------------------------------------------------------------------------------

def test_every_rule_reads_an_exported_series_per_pod() -> None:
    for rule in _rules():
        assert m.metric_of_series(_series_of(rule)) is not None, f"{rule['seriesQuery']}: not exported by pdserve"
        assert 'namespace!=""' in rule["seriesQuery"] and 'pod!=""' in rule["seriesQuery"]
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        for var in ("<<.Series>>", "<<.LabelMatchers>>", "<<.GroupBy>>"):
            assert var in rule["metricsQuery"], f"{served_name(rule)}: {var} missing from metricsQuery"
    names = [served_name(r) for r in _rules()]
    assert len(names) == len(set(names)), names


EXPECTED_PER_POD = {
    "pdserve_prefill_waiting_requests": {"prefill-0": 2.0, "prefill-1": 4.0},
    # prefill-1 queued nothing in the window: no value (a NaN would reach the HPA as a bogus quantity).
    "pdserve_prefill_queue_seconds_p90": {"prefill-0": _quantile(m.PREFILL_QUEUE_SECONDS, 0.9)},
    "pdserve_decode_running_requests": {"decode-0": 5.0, "decode-1": 7.0},
    "pdserve_decode_kv_cache_usage_ratio": {"decode-0": 0.35, "decode-1": 0.8},
}
"""Per pod, from the known series of tests/common/test_dashboard_values.py."""


def test_every_rule_gives_the_known_value_per_pod(known: tuple[PrometheusHarness, float]) -> None:  # noqa: F811
    prom, at = known
    assert {served_name(r) for r in _rules()} == set(EXPECTED_PER_POD)
    for rule in _rules():
        name = served_name(rule)
        pods = ["prefill-0", "prefill-1"] if "prefill" in name else ["decode-0", "decode-1"]
        got = {r["metric"]["pod"]: float(r["value"][1]) for r in prom.query(expand(rule, pods), at=at)}
        want = EXPECTED_PER_POD[name]
        assert set(got) == set(want), f"{name}: pods {sorted(got)} != {sorted(want)}"
        for pod, value in want.items():
            assert got[pod] == pytest.approx(value, rel=1e-6), f"{name} {pod}: {got[pod]} != {value}"
    # Only the asked-for pods, and only this namespace (the same series 1000x larger live elsewhere).
    (one,) = prom.query(expand(_rules()[2], ["decode-1"]), at=at)
    assert one["metric"]["pod"] == "decode-1" and float(one["value"][1]) == pytest.approx(7.0)


# ---- the HPAs -------------------------------------------------------------------------------------------

def quantity(q: str) -> float:
    """A Kubernetes quantity as the HPA targets use them: plain, or milli (`500m`)."""
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def _hpas(objs: tuple[dict[str, Any], ...]) -> dict[str, dict[str, Any]]:
    return {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "HorizontalPodAutoscaler"}


@needs_kubectl
@pytest.mark.parametrize("kustomization", AUTOSCALED)
def test_prefill_and_decode_scale_apart_on_their_own_signals(kustomization: str) -> None:
    objs = render(kustomization)
    hpas = _hpas(objs)
    assert set(hpas) == {"pdserve-prefill", "pdserve-decode"}, sorted(hpas)
    served = {served_name(r) for r in _rules()}
    for role in ("prefill", "decode"):
        w = workload_of(objs, role)
        hpa = hpas[w["metadata"]["name"]]
        assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["scaleTargetRef"]["kind"] == w["kind"]
        assert "replicas" not in w["spec"], f"{role}: `kubectl apply` would reset the HPA's count"
        names = [x["pods"]["metric"]["name"] for x in hpa["spec"]["metrics"]]
        assert all(x["type"] == "Pods" for x in hpa["spec"]["metrics"])
        assert len(names) == 2 and all(n.startswith(f"pdserve_{role}_") for n in names), f"{role}: {names}"
        assert set(names) <= served, f"{role}: no prometheus-adapter rule serves {set(names) - served}"
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        behavior = hpa["spec"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] > behavior["scaleUp"]["stabilizationWindowSeconds"]


@needs_kubectl
@pytest.mark.parametrize("kustomization", AUTOSCALED)
def test_decode_targets_sit_below_what_a_decode_holds(kustomization: str) -> None:
    objs = render(kustomization)
    targets = {x["pods"]["metric"]["name"]: quantity(x["pods"]["target"]["averageValue"])
               for hpa in _hpas(objs).values() for x in hpa["spec"]["metrics"]}
    max_seqs = effective_config(objs, "decode")[EngineConfig].max_num_seqs
    assert 0 < targets["pdserve_decode_running_requests"] < max_seqs  # scale before the batch is full
    assert 0 < targets["pdserve_decode_kv_cache_usage_ratio"] < 1
    assert targets["pdserve_prefill_waiting_requests"] >= 1 and 0 < targets["pdserve_prefill_queue_seconds_p90"]


@needs_kubectl
def test_overlays_without_the_component_keep_fixed_replicas() -> None:
    for kustomization in ("base", "overlays/cpu-local", "overlays/gpu"):
        objs = render(kustomization)
        assert not _hpas(objs), kustomization
        assert workload_of(objs, "decode")["spec"]["replicas"] >= 1, kustomization


# ---- the KEDA form ----------------------------------------------------------------------------------------

KEDA = K8S / "components" / "autoscaling-keda" / "scaledobjects.yaml"
KEDA_EXPECTED = {
    "waiting-requests": 2.0 + 4.0,  # summed over pods; AverageValue divides by the replicas
    "queue-wait-p90": _quantile(m.PREFILL_QUEUE_SECONDS, 0.9),  # prefill-1 queued nothing: left out of the mean
    "running-requests": 5.0 + 7.0,
    "kv-cache-usage": (0.35 + 0.8) / 2,
}
"""Each trigger's query on the known series of tests/common/test_dashboard_values.py."""


def _scaled_objects() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(KEDA.read_text()) if d]


def test_every_keda_query_gives_the_known_value(known: tuple[PrometheusHarness, float]) -> None:  # noqa: F811
    prom, at = known
    triggers = {t["name"]: t for so in _scaled_objects() for t in so["spec"]["triggers"]}
    assert set(triggers) == set(KEDA_EXPECTED)
    for name, t in triggers.items():
        assert t["type"] == "prometheus"
        query = t["metadata"]["query"]
        assert 'namespace="pdserve"' in query, f"{name}: the query must select pdserve's namespace"
        (result,) = prom.query(query.replace('namespace="pdserve"', f'namespace="{TEST_NAMESPACE}"'), at=at)
        assert float(result["value"][1]) == pytest.approx(KEDA_EXPECTED[name], rel=1e-6), name


@needs_kubectl
def test_keda_scales_prefill_and_decode_apart_with_the_adapter_forms_targets() -> None:
    objs = render("overlays/autoscaling-keda")
    assert not _hpas(objs), "KEDA owns the HPAs: none may be shipped next to its ScaledObjects"
    sos = {o["spec"]["scaleTargetRef"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}
    assert set(sos) == {"pdserve-prefill", "pdserve-decode"}
    hpas = _hpas(render("overlays/autoscaling"))
    for role in ("prefill", "decode"):
        w = workload_of(objs, role)
        so = sos[w["metadata"]["name"]]
        assert "replicas" not in w["spec"], role
        for t in so["spec"]["triggers"]:
            assert re.findall(r"\bpdserve_([a-z]+)_", t["metadata"]["query"]) == [role], f"{role}: {t['name']}"
        hpa = hpas[w["metadata"]["name"]]["spec"]
        assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (hpa["minReplicas"], hpa["maxReplicas"])
        assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"] == hpa["behavior"]
        thresholds = sorted(float(t["metadata"]["threshold"]) for t in so["spec"]["triggers"])
        assert thresholds == sorted(quantity(x["pods"]["target"]["averageValue"]) for x in hpa["metrics"]), role
