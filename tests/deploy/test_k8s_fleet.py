"""deploy/k8s fleet features: the NetworkPolicies enforce the trust model (evaluated with Kubernetes'
NetworkPolicy rules over every pod and declared port of the render), the Mooncake Transfer Engine ports are
declared and match the range the engines take them from, the monitoring overlay carries the PodMonitor and
the dashboards, and image digests set through kustomize reach every container."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.engine.config import EngineConfig
from tests.deploy.test_k8s_manifests import (
    K8S,
    KUSTOMIZATIONS,
    REPO,
    _render_dir,
    container_env,
    effective_config,
    render,
    service_container,
    workload_of,
    workloads,
)
from tests.deploy.test_k8s_mooncake_kv import MOONCAKE_PORT_RANGE_ENV, WITH_KV

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not on PATH: `kubectl kustomize` is needed to render deploy/k8s")

NAMESPACE = "pdserve"


# ---- NetworkPolicy semantics ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Peer:
    """A pod (``labels`` set) or a host outside the cluster (``pod`` False); ``ports``: name -> (port, proto)."""

    name: str
    namespace: str
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    ports: dict[str, tuple[int, str]] = field(default_factory=dict, hash=False)
    pod: bool = True


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"evaluator handles matchLabels only: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_matches(peers: list[dict[str, Any]] | None, policy_ns: str, other: Peer) -> bool:
    if not peers:
        return True  # no from/to: every source or destination
    for p in peers:
        assert "ipBlock" not in p, "evaluator handles pod and namespace selectors only"
        if not other.pod:
            continue
        ns_ok = (_matches(p["namespaceSelector"], {"kubernetes.io/metadata.name": other.namespace})
                 if "namespaceSelector" in p else other.namespace == policy_ns)
        pod_ok = _matches(p["podSelector"], other.labels) if "podSelector" in p else True
        if ns_ok and pod_ok:
            return True
    return False


def _port_matches(ports: list[dict[str, Any]] | None, dst: Peer, port: int, proto: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != proto:
            continue
        if "port" not in p:
            return True
        if isinstance(p["port"], str):  # a named port: the destination pod's container port of that name
            if dst.ports.get(p["port"]) == (port, proto):
                return True
        elif p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _direction_allows(policies: list[dict[str, Any]], subject: Peer, other: Peer, dst: Peer, port: int, proto: str,
                      kind: str) -> bool:
    """Does ``subject``'s namespace let it send (Egress) to / receive (Ingress) from ``other``?"""
    if not subject.pod:
        return True
    selecting = [p for p in policies if p["metadata"].get("namespace", NAMESPACE) == subject.namespace
                 and _matches(p["spec"]["podSelector"], subject.labels)
                 and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True  # not isolated in this direction
    key, peers_key = ("egress", "to") if kind == "Egress" else ("ingress", "from")
    return any(_peer_matches(rule.get(peers_key), subject.namespace, other) and
               _port_matches(rule.get("ports"), dst, port, proto)
               for p in selecting for rule in p["spec"].get(key, []))


def allowed(policies: list[dict[str, Any]], src: Peer, dst: Peer, port: int, proto: str = "TCP") -> bool:
    return (_direction_allows(policies, src, dst, dst, port, proto, "Egress")
            and _direction_allows(policies, dst, src, dst, port, proto, "Ingress"))


def pdserve_pods(objs: tuple[dict[str, Any], ...]) -> list[Peer]:
    out = []
    for w in workloads(objs):
        tmpl = w["spec"]["template"]
        ports = {p["name"]: (p["containerPort"], p.get("protocol", "TCP"))
                 for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        out.append(Peer(tmpl["metadata"]["labels"]["app.kubernetes.io/component"], w["metadata"]["namespace"],
                        tmpl["metadata"]["labels"], ports))
    return out


OUTSIDE = Peer("outside", "", pod=False)
MONITORING = Peer("monitoring", "monitoring", {"app.kubernetes.io/name": "prometheus"})
OTHER = Peer("other-namespace", "apps", {"app": "client"})
KUBE_DNS = Peer("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")})
INTERNET = Peer("internet", "", pod=False)

EXTERNAL = ("outside", "monitoring", "other-namespace")
OPEN: set[tuple[str, str, str]] = {
    # (source, destination, destination port name); "mooncake-*": every Transfer Engine port
    *((src, "router", port) for src in EXTERNAL for port in ("http", "grpc")),  # the public API
    ("router", "prefill", "grpc"),
    ("router", "decode", "grpc"),
    ("prefill", "decode", "grpc"),  # PushKV shares decode's gRPC port with the router's RPCs
    ("prefill", "decode", "mooncake-*"),
    ("prefill", "kvstore", "grpc"),  # Get, Put, Lookup and Delete share the port
    ("kvstore", "kvstore", "mooncake-*"),  # Mooncake Store peers
    ("kvstore", "mooncake-master", "rpc"),
}
"""Everything the policies let through between these peers; every other (source, port) is closed."""

POLICY_KUSTOMIZATIONS = ("overlays/network-policy", "overlays/mooncake+network-policy",
                         "overlays/gpu+mooncake+mooncake-kv+network-policy")


def _policies(objs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == "NetworkPolicy"]


@pytest.mark.parametrize("kustomization", POLICY_KUSTOMIZATIONS)
def test_network_policies_open_exactly_the_trust_model(kustomization: str) -> None:
    objs = render(kustomization)
    policies = _policies(objs)
    pods = pdserve_pods(objs)
    sources = [*pods, OUTSIDE, MONITORING, OTHER]
    got = set()
    for dst in pods:
        for port_name, (port, proto) in dst.ports.items():
            for src in sources:
                if allowed(policies, src, dst, port, proto):
                    name = "mooncake-*" if port_name.startswith("mooncake-") else port_name
                    got.add((src.name, dst.name, name))
    expected = {e for e in OPEN if e[1] in {p.name for p in pods} and e[0] in {s.name for s in sources}
                and any(n == e[2] or (e[2] == "mooncake-*" and n.startswith("mooncake-"))
                        for p in pods if p.name == e[1] for n in p.ports)}
    expected |= {("monitoring", p.name, "metrics") for p in pods}
    assert got - expected == set(), f"open beyond the trust model: {sorted(got - expected)}"
    assert expected - got == set(), f"closed although needed: {sorted(expected - got)}"


@pytest.mark.parametrize("kustomization", POLICY_KUSTOMIZATIONS)
def test_every_pod_resolves_names_and_reaches_nothing_else_outside(kustomization: str) -> None:
    objs = render(kustomization)
    policies = _policies(objs)
    for pod in pdserve_pods(objs):
        assert allowed(policies, pod, KUBE_DNS, 53, "UDP") and allowed(policies, pod, KUBE_DNS, 53, "TCP"), pod.name
        assert not allowed(policies, pod, KUBE_DNS, 443), pod.name
        assert not allowed(policies, pod, INTERNET, 443), f"{pod.name} reaches the internet"
        assert not allowed(policies, pod, OTHER, 8080), f"{pod.name} reaches another namespace"


def test_every_port_the_policies_name_is_declared_by_the_pods_it_leads_to() -> None:
    """A named port every destination pod declares; a numeric range exactly the Transfer Engine ports."""
    objs = render("overlays/gpu+mooncake+mooncake-kv+network-policy")
    pods = pdserve_pods(objs)
    for p in _policies(objs):
        name = p["metadata"]["name"]
        for key, peers_key in (("ingress", "from"), ("egress", "to")):
            for rule in p["spec"].get(key, []):
                targets = ([d for d in pods if _matches(p["spec"]["podSelector"], d.labels)] if key == "ingress"
                           else [d for d in pods if rule.get(peers_key) and _peer_matches(rule[peers_key], NAMESPACE, d)])
                for port in rule.get("ports", []):
                    if not targets:
                        continue  # DNS (kube-system) and metrics (monitoring) lead outside pdserve
                    if isinstance(port["port"], str):
                        assert all(port["port"] in d.ports for d in targets), f"{name}: {port}"
                        continue
                    span = set(range(port["port"], port.get("endPort", port["port"]) + 1))
                    for d in targets:
                        engine = {num for n, (num, _) in d.ports.items() if n.startswith("mooncake-")}
                        assert engine == span, f"{name}: {port} vs {d.name}'s engine ports {sorted(engine)}"


def test_without_the_policies_everything_is_open() -> None:
    """The evaluator is not closed by default: the same pods with no policy reach every port."""
    pods = pdserve_pods(render("overlays/mooncake"))
    router, prefill = next(p for p in pods if p.name == "router"), next(p for p in pods if p.name == "prefill")
    assert allowed([], OTHER, prefill, 50061) and allowed([], router, INTERNET, 443)


# ---- Mooncake Transfer Engine ports --------------------------------------------------------------------

def _engine_ports(c: dict[str, Any], env: dict[str, str]) -> tuple[set[int], set[int]]:
    """(the containerPorts named mooncake-*, the range MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)."""
    declared = {p["containerPort"] for p in c.get("ports", []) if p["name"].startswith("mooncake-")}
    lo, hi = (int(env[k]) for k in MOONCAKE_PORT_RANGE_ENV)
    return declared, set(range(lo, hi + 1))


@pytest.mark.parametrize("kustomization", WITH_KV)
@pytest.mark.parametrize("component", ["prefill", "decode"])
def test_kv_transfer_engine_ports_are_declared_and_fit_every_engine(kustomization: str, component: str) -> None:
    objs = render(kustomization)
    w = workload_of(objs, component)
    c = service_container(w)
    env, _ = container_env(objs, w, c)
    declared, port_range = _engine_ports(c, env)
    assert declared == port_range, f"{component}: declared {sorted(declared)} != range {sorted(port_range)}"
    cfgs = effective_config(objs, component)
    cfg = next(v for v in cfgs.values() if hasattr(v, "kv_mooncake_engines"))
    ranks = cfgs[EngineConfig].tensor_parallel_size
    # Each engine takes an RPC port and a TCP data port; every tensor-parallel rank runs its own engines.
    assert len(port_range) >= 2 * cfg.kv_mooncake_engines * ranks, f"{component}: {len(port_range)} ports"


@pytest.mark.parametrize("kustomization", ["overlays/mooncake", "overlays/gpu+mooncake"])
def test_store_transfer_engine_ports_are_declared(kustomization: str) -> None:
    objs = render(kustomization)
    w = workload_of(objs, "kvstore")
    c = service_container(w)
    env, _ = container_env(objs, w, c)
    declared, port_range = _engine_ports(c, env)
    assert declared == port_range and len(port_range) >= 2, sorted(declared)  # one engine: RPC + data port


def test_without_mooncake_no_engine_ports_are_declared() -> None:
    for kustomization in ("base", "overlays/cpu-local", "overlays/gpu"):
        for w in workloads(render(kustomization)):
            for c in w["spec"]["template"]["spec"]["containers"]:
                assert not [p for p in c.get("ports", []) if p["name"].startswith("mooncake-")], kustomization
                assert not [e for e in c.get("env", []) if e["name"] in MOONCAKE_PORT_RANGE_ENV], kustomization


# ---- monitoring ----------------------------------------------------------------------------------------

def test_monitoring_overlay_carries_the_podmonitor_and_the_dashboards() -> None:
    objs = render("overlays/monitoring")
    monitor = next(o for o in objs if o["kind"] == "PodMonitor")
    assert monitor["metadata"]["namespace"] == NAMESPACE  # it selects pods of its own namespace
    source = yaml.safe_load((REPO / "deploy/prometheus/podmonitor.yaml").read_text())
    assert monitor["spec"] == source["spec"]
    dashboards = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "pdserve-grafana-dashboards")
    committed = yaml.safe_load((REPO / "deploy/grafana/dashboards-configmap.yaml").read_text())
    assert dashboards["data"] == committed["data"] and dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"


# ---- image digests -------------------------------------------------------------------------------------

DIGEST = "sha256:" + "0123456789abcdef" * 4


def _render_with_digest(kustomization: str) -> tuple[dict[str, Any], ...]:
    overlay, *components = kustomization.split("+")
    with tempfile.TemporaryDirectory() as d:
        rel = Path(os.path.relpath(K8S, d))
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [str(rel / overlay)], "components": [str(rel / "components" / c) for c in components],
            "images": [{"name": "pdserve", "newName": "registry.example.com/pdserve", "digest": DIGEST}]}))
        return _render_dir(Path(d))


@pytest.mark.parametrize("kustomization", [*KUSTOMIZATIONS, "overlays/gpu+mooncake"])
def test_an_image_digest_set_through_kustomize_reaches_every_container(kustomization: str) -> None:
    for w in workloads(_render_with_digest(kustomization)):
        spec = w["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["image"] == f"registry.example.com/pdserve@{DIGEST}", f"{w['metadata']['name']}: {c['image']}"
            assert re.fullmatch(r"[^:@]+@sha256:[0-9a-f]{64}", c["image"])
