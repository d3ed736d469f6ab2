"""deploy/k8s: every kustomization renders, validates against the Kubernetes OpenAPI schema (strict), and
keeps the contract with the services: probes on the gRPC port, metrics port and Prometheus annotations,
drain-aware termination grace, router targets that are real headless Services, and only flags / PDSERVE_*
env vars the services actually declare (parsed with the services' own config dataclasses); pods listen
on every interface (the services' defaults are loopback), and under mTLS every service runs with its
role's certificate from a Secret, probed through `pdserve health` (kubelet grpc: probes speak no TLS)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from services.common.config import add_dataclass_args, env_name, from_args

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = ("base", "overlays/cpu-local", "overlays/gpu", "overlays/mooncake", "overlays/api-key",
                  "overlays/monitoring", "overlays/autoscaling", "overlays/autoscaling-keda", "overlays/network-policy")
OVERLAYS = tuple(k for k in KUSTOMIZATIONS if k != "base")
COMPONENTS = ("router", "prefill", "decode", "kvstore")
# kubernetes-validate ships schemas up to its own release; 1.33 is what current kind/minikube/EKS/GKE run
# (native grpc probes are GA since 1.27, the preStop sleep action since 1.30 on by default).
K8S_VERSION = "1.33.0"
# Custom resources kubernetes-validate has no schema for: JSON schemas committed next to these tests,
# written from the CRDs' published structure (strict: unknown fields are errors).
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.monitoring.coreos.com_v1.json",
               ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.keda.sh_v1alpha1.json",
               ("cert-manager.io/v1", "Certificate"): "certificate.cert-manager.io_v1.json",
               ("cert-manager.io/v1", "Issuer"): "issuer.cert-manager.io_v1.json"}
SCHEMAS = Path(__file__).resolve().parent / "schemas"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not on PATH: `kubectl kustomize` is needed to render deploy/k8s")


# ---- rendering and lookups -------------------------------------------------------------------------

@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """Render deploy/k8s/<kustomization>, or a combination "overlays/gpu+mooncake": the overlay with
    those components added (a kustomization written to a temporary directory, in the overlays' namespace
    as an overlay adding them would be, so that objects the components add land there too)."""
    if "+" not in kustomization:
        return _render_dir(K8S / kustomization)
    overlay, *components = kustomization.split("+")
    with tempfile.TemporaryDirectory() as d:
        rel = Path(os.path.relpath(K8S, d))
        (Path(d) / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "pdserve",
            "resources": [str(rel / overlay)], "components": [str(rel / "components" / c) for c in components]}))
        return _render_dir(Path(d))


def _render_dir(path: Path) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(d for d in yaml.load_all(proc.stdout, Loader=loader) if d)


def find(objs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any] | None:
    return next((o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name), None)


def workloads(objs: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def workload_of(objs: tuple[dict[str, Any], ...], component: str) -> dict[str, Any]:
    found = [w for w in workloads(objs)
             if w["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one workload with component={component}, got {len(found)}"
    return found[0]


def service_container(w: dict[str, Any]) -> dict[str, Any]:
    """The container running ``python -m services.<x>`` (args[0]; the image's ENTRYPOINT is python -m)."""
    found = [c for c in w["spec"]["template"]["spec"]["containers"]
             if c.get("args") and str(c["args"][0]).startswith("services.")]
    assert len(found) == 1, f"{w['metadata']['name']}: expected one pdserve service container"
    assert "command" not in found[0], f"{w['metadata']['name']}: keep the image ENTRYPOINT (python -m)"
    return found[0]


def pod(kustomization: str, component: str) -> tuple[tuple[dict[str, Any], ...], dict[str, Any], dict[str, Any]]:
    """(every rendered object, the component's workload, its service container)."""
    objs = render(kustomization)
    w = workload_of(objs, component)
    return objs, w, service_container(w)


def port_named(c: dict[str, Any], name: str) -> int | None:
    return next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == name), None)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def namespace_of(o: dict[str, Any]) -> str:
    return o["metadata"].get("namespace", "default")


# ---- the services' own flag and env declarations ------------------------------------------------------

def config_classes(service: str) -> list[type] | None:
    """The dataclasses whose flags ``python -m services.<service>`` parses (None: not written yet)."""
    from services.common.logging import LoggingConfig

    if importlib.util.find_spec(f"services.{service}.config") is None:
        return None
    mod = importlib.import_module(f"services.{service}.config")
    own = [v for v in vars(mod).values()
           if isinstance(v, type) and dataclasses.is_dataclass(v) and v.__module__ == mod.__name__]
    extra: list[type] = []
    if service in ("prefill", "decode"):
        from services.engine.config import EngineConfig
        extra.append(EngineConfig)
    return [*own, *extra, LoggingConfig]


@functools.cache
def service_parser(service: str) -> tuple[argparse.ArgumentParser, frozenset[str], tuple[type, ...]] | None:
    classes = config_classes(service)
    if classes is None:
        return None
    p = argparse.ArgumentParser(prog=f"pdserve {service}", exit_on_error=False)
    for cls in classes:
        add_dataclass_args(p, cls)
    envs = frozenset(env_name(f) for cls in classes for f in dataclasses.fields(cls) if f.init)
    return p, envs, tuple(classes)


def container_env(objs: tuple[dict[str, Any], ...], w: dict[str, Any], c: dict[str, Any]
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """(env the container sees with values where known, name -> where it came from). Downward-API values
    are placeholders; ConfigMap keys are resolved from the render."""
    values: dict[str, str] = {}
    origin: dict[str, str] = {}
    ns = namespace_of(w)
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef")
        assert ref is not None, f"{c['name']}: only configMapRef envFrom is expected"
        cm = find(objs, "ConfigMap", ref["name"])
        assert cm is not None, f"{c['name']}: envFrom ConfigMap {ref['name']} not in the render"
        for k, v in cm.get("data", {}).items():
            values[src.get("prefix", "") + k], origin[src.get("prefix", "") + k] = v, f"ConfigMap {ref['name']}"
    placeholders = {"metadata.name": f"{w['metadata']['name']}-0", "metadata.namespace": ns,
                    "status.podIP": "10.0.0.7"}
    for e in c.get("env", []):
        name = e["name"]
        origin[name] = "env"
        if "value" in e:
            values[name] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["configMapKeyRef"]
            cm = find(objs, "ConfigMap", ref["name"])
            assert cm is not None and ref["key"] in cm.get("data", {}), \
                f"{c['name']}: env {name} refers to a missing ConfigMap key {ref['name']}/{ref['key']}"
            values[name] = cm["data"][ref["key"]]
        elif "fieldRef" in e["valueFrom"]:
            values[name] = placeholders[e["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in e["valueFrom"]:
            values[name] = "1"
    return values, origin


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion in args (unknown variables stay as written, like the kubelet)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def mounted_secret(w: dict[str, Any], c: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(Secret name, key) of a file ``path`` under one of the container's Secret mounts (which must be
    read-only), else None."""
    vols = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
    for m in c.get("volumeMounts", []):
        secret = vols.get(m["name"], {}).get("secret")
        root = m["mountPath"].rstrip("/") + "/"
        if secret is not None and path.startswith(root):
            assert m.get("readOnly") is True, f"{c['name']}: Secret mount {root} is not readOnly"
            return secret["secretName"], path[len(root):]
    return None


_MOUNTS = Path(tempfile.mkdtemp(prefix="pdserve-deploy-test-"))


def localize(w: dict[str, Any], c: dict[str, Any], value: str) -> str:
    """A file under a Secret mount (as a value or ``--flag=value``) -> an empty local stand-in (configs
    check that their files exist)."""
    flag, eq, path = value.partition("=") if value.startswith("--") else ("", "", value)
    found = mounted_secret(w, c, path)
    if found is None:
        return value
    local = _MOUNTS / found[0] / found[1]
    local.parent.mkdir(parents=True, exist_ok=True)
    local.touch()
    return f"{flag}{eq}{local}"


def effective_config(objs: tuple[dict[str, Any], ...], component: str) -> dict[type, Any]:
    """Build the service's configs exactly as it would at start: its args, then its env (files from
    Secret mounts stand in as empty local files)."""
    parsed = service_parser(component)
    assert parsed is not None
    parser, _, classes = parsed
    w = workload_of(objs, component)
    c = service_container(w)
    env, _ = container_env(objs, w, c)
    env = {k: localize(w, c, v) for k, v in env.items()}
    ns = parser.parse_args([localize(w, c, expand(a, env)) for a in c["args"][1:]])
    return {cls: from_args(cls, ns, environ=env) for cls in classes}


def server_config(cfgs: dict[type, Any]) -> Any:
    from services.common.server import ServerConfig

    return next(v for k, v in cfgs.items() if issubclass(k, ServerConfig))


def require_parser(component: str) -> None:
    assert service_parser(component) is not None, f"services/{component}/config.py defines no config"


# ---- render + schema --------------------------------------------------------------------------------

@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_with_every_component(kustomization: str) -> None:
    objs = render(kustomization)
    for component in COMPONENTS:
        workload_of(objs, component)
    for o in objs:
        assert o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "pdserve" or \
            o["kind"] == "Namespace", f"{o['kind']}/{o['metadata']['name']}: label app.kubernetes.io/part-of"


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = yaml.safe_load((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def validation_errors(objs: tuple[dict[str, Any], ...]) -> list[str]:
    """Every object against the Kubernetes OpenAPI schema (strict), custom resources against CRD_SCHEMAS."""
    errors = []
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS:
            for e in _crd_validator(o["apiVersion"], o["kind"]).iter_errors(o):
                errors.append(f"{name} at {'/'.join(str(p) for p in e.absolute_path)}: {e.message}")
            continue
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{name} at {'/'.join(str(p) for p in e.absolute_path)}: {e.message}")
    return errors


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_validates_strictly(kustomization: str) -> None:
    errors = validation_errors(render(kustomization))
    assert not errors, "\n".join(errors)


def test_the_podmonitor_schema_refuses_what_the_crd_refuses() -> None:
    monitor = yaml.safe_load((REPO / "deploy/prometheus/podmonitor.yaml").read_text())
    assert validation_errors((monitor,)) == []
    bad_interval = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoints": [
        {**monitor["spec"]["podMetricsEndpoints"][0], "interval": "15 seconds"}]}}
    unknown_field = {**monitor, "spec": {**monitor["spec"], "podMetricsEndpoint": []}}
    no_selector = {**monitor, "spec": {"podMetricsEndpoints": monitor["spec"]["podMetricsEndpoints"]}}
    for bad in (bad_interval, unknown_field, no_selector):
        assert validation_errors((bad,)) != [], bad["spec"]


def test_the_scaledobject_schema_refuses_what_the_crd_refuses() -> None:
    path = REPO / "deploy/k8s/components/autoscaling-keda/scaledobjects.yaml"
    so = next(d for d in yaml.safe_load_all(path.read_text()) if d)
    assert validation_errors((so,)) == []
    trigger = so["spec"]["triggers"][0]
    bad_type = {**so, "spec": {**so["spec"], "triggers": [{**trigger, "metricType": "Average"}]}}
    unknown_field = {**so, "spec": {**so["spec"], "maxReplicas": 8}}
    no_triggers = {**so, "spec": {k: v for k, v in so["spec"].items() if k != "triggers"}}
    number_metadata = {**so, "spec": {**so["spec"], "triggers": [{**trigger, "metadata": {"threshold": 4}}]}}
    for bad in (bad_type, unknown_field, no_triggers, number_metadata):
        assert validation_errors((bad,)) != [], bad["spec"]


def test_base_is_namespace_agnostic_and_overlays_set_one() -> None:
    for o in render("base"):
        assert "namespace" not in o["metadata"], f"base {o['kind']}/{o['metadata']['name']} sets a namespace"
    for overlay in OVERLAYS:
        for o in render(overlay):
            if o["kind"] != "Namespace":
                where = f"{overlay}: {o['kind']}/{o['metadata']['name']}"
                assert o["metadata"].get("namespace") == "pdserve", where


# ---- pod contract ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_container_is_probed_scraped_and_bounded(kustomization: str) -> None:
    objs = render(kustomization)
    for w in workloads(objs):
        name = f"{kustomization}: {w['kind']}/{w['metadata']['name']}"
        tmpl = w["spec"]["template"]
        labels, ann, pod = tmpl["metadata"]["labels"], tmpl["metadata"].get("annotations", {}), tmpl["spec"]
        assert selects(w["spec"]["selector"]["matchLabels"], labels), name
        assert labels.get("app.kubernetes.io/name") == "pdserve" and "app.kubernetes.io/component" in labels, name
        assert ann.get("prometheus.io/scrape") == "true", name
        assert pod["securityContext"].get("runAsNonRoot") is True, name
        if labels["app.kubernetes.io/component"] in COMPONENTS:
            assert pod.get("topologySpreadConstraints"), f"{name}: no topologySpreadConstraints"
        for tsc in pod.get("topologySpreadConstraints", []):
            assert selects(tsc["labelSelector"]["matchLabels"], labels), f"{name}: spread selector"
        for c in pod["containers"]:
            metrics = port_named(c, "metrics")
            assert metrics is not None, f"{name}/{c['name']}: no containerPort named metrics"
            assert ann.get("prometheus.io/port") == str(metrics), f"{name}: prometheus.io/port != metrics port"
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert probe in c, f"{name}/{c['name']}: no {probe}"
            req = c.get("resources", {}).get("requests", {})
            assert "cpu" in req and "memory" in req, f"{name}/{c['name']}: cpu and memory requests"
            assert "memory" in c["resources"].get("limits", {}), f"{name}/{c['name']}: memory limit"
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"
            assert sc.get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}"
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            assert tmp and "emptyDir" in vols[tmp[0]["name"]], f"{name}/{c['name']}: /tmp must be an emptyDir"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_service_probes_ports_and_drain_match_its_config(kustomization: str, component: str) -> None:
    objs, w, c = pod(kustomization, component)
    assert c["args"][0] == f"services.{component}", f"{component} pod runs {c['args'][0]}"
    require_parser(component)
    server = server_config(effective_config(objs, component))
    assert port_named(c, "grpc") == server.port, f"{component}: grpc containerPort != --port {server.port}"
    assert port_named(c, "metrics") == server.metrics_port, f"{component}: metrics port != --metrics-port"
    env, _ = container_env(objs, w, c)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if server.tls_enabled:
            assert_health_exec_probe(w, c, env, probe, server.port)
        else:
            assert c[probe].get("grpc", {}).get("port") == server.port, \
                f"{component}: {probe} is not grpc:{server.port}"
    # Startup is for model loading; liveness must not fire during it (the startup probe gates it).
    startup = c["startupProbe"]
    assert startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3) >= 60, f"{component}: startup"
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + server.drain_timeout_s + server.grace_s, \
        f"{component}: terminationGracePeriodSeconds {grace} <= preStop {pre_stop} + drain " \
        f"{server.drain_timeout_s} + grace {server.grace_s}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_flags_and_env_vars_are_declared_by_the_service(kustomization: str, component: str) -> None:
    objs, w, c = pod(kustomization, component)
    require_parser(component)
    parsed = service_parser(component)
    assert parsed is not None
    parser, envs, _ = parsed
    known_flags = set(parser._option_string_actions)
    for arg in c["args"][1:]:
        assert arg.startswith("--"), f"{component}: positional arg {arg!r} (use --flag=value)"
        flag = arg.split("=", 1)[0]
        assert flag in known_flags, f"{kustomization}: {component} has no flag {flag}"
    env, origin = container_env(objs, w, c)
    for name in env:
        if name.startswith("PDSERVE_"):
            assert name in envs, f"{kustomization}: {component} declares no env var {name} (from {origin[name]})"
    effective_config(objs, component)  # every value parses and validates (ConfigError otherwise)


def assert_health_exec_probe(w: dict[str, Any], c: dict[str, Any], env: dict[str, str], probe: str,
                             port: int) -> None:
    """Under mTLS a probe runs `python -m services.cli health --address=127.0.0.1:<port>`, which finds the
    pod's certificate through the container's PDSERVE_TLS_* env (the kubelet's grpc: probe has no TLS)."""
    from services.cli import health_parser
    from services.common.tls import TLSConfig

    p = c[probe]
    where = f"{c['name']} {probe}"
    assert "grpc" not in p, f"{where}: a grpc: probe cannot pass mTLS"
    cmd = p.get("exec", {}).get("command", [])
    assert cmd[:4] == ["python", "-m", "services.cli", "health"], f"{where}: {cmd}"
    ns = health_parser().parse_args(cmd[4:])
    assert ns.address == f"127.0.0.1:{port}", f"{where}: checks {ns.address}"
    tls = from_args(TLSConfig, ns, environ={k: localize(w, c, v) for k, v in env.items()})
    assert tls.tls_enabled, f"{where}: the probe would not present a certificate"
    assert p.get("timeoutSeconds", 1) >= 5, f"{where}: a Python start needs timeoutSeconds >= 5"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_pods_listen_on_every_interface(kustomization: str, component: str) -> None:
    """The services bind loopback by default; in a pod the kubelet, Services and peers come in on the
    pod IP, so every listener is told 0.0.0.0 explicitly."""
    require_parser(component)
    cfgs = effective_config(render(kustomization), component)
    server = server_config(cfgs)
    assert (server.host, server.metrics_host) == ("0.0.0.0", "0.0.0.0"), f"{kustomization}: {component}"
    if component == "router":
        from services.router.config import RouterConfig
        assert cfgs[RouterConfig].http_host == "0.0.0.0", f"{kustomization}: router HTTP"


# ---- wiring between services ------------------------------------------------------------------------

def service_for(objs: tuple[dict[str, Any], ...], host: str, client_ns: str) -> dict[str, Any]:
    """The Service a DNS name resolves to from a pod in ``client_ns`` (short or FQDN form)."""
    parts = host.split(".")
    ns = parts[1] if len(parts) > 1 else client_ns
    if len(parts) > 2:
        assert parts[2:] == ["svc", "cluster", "local"], f"{host}: not <svc>.<ns>.svc.cluster.local"
    svc = find(objs, "Service", parts[0])
    assert svc is not None, f"{host}: no Service {parts[0]} in the render"
    assert namespace_of(svc) == ns, f"{host}: Service {parts[0]} is in {namespace_of(svc)}, not {ns}"
    return svc


def assert_serves(objs: tuple[dict[str, Any], ...], svc: dict[str, Any], port: int, component: str) -> None:
    sp = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
    assert sp is not None, f"Service {svc['metadata']['name']} has no port {port}"
    w = workload_of(objs, component)
    assert selects(svc["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), \
        f"Service {svc['metadata']['name']} does not select the {component} pods"
    c = service_container(w)
    target = sp.get("targetPort", sp["port"])
    container_port = port_named(c, target) if isinstance(target, str) else target
    assert container_port == port_named(c, "grpc"), \
        f"Service {svc['metadata']['name']}:{port} does not reach {component}'s grpc port"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_router_targets_are_the_headless_services(kustomization: str) -> None:
    objs, w, c = pod(kustomization, "router")
    env, _ = container_env(objs, w, c)
    ns_env = next(e for e in c["env"] if e["name"] == "POD_NAMESPACE")
    assert ns_env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    args = dict(a.split("=", 1) for a in c["args"][1:])
    for role in ("prefill", "decode"):
        target = expand(args[f"--{role}"], env)
        m = re.fullmatch(r"dns:([a-z0-9.-]+):(\d+)", target)
        assert m, f"--{role}={target}: expected dns:NAME:PORT"
        svc = service_for(objs, m.group(1), namespace_of(w))
        assert svc["spec"].get("clusterIP") == "None", f"{svc['metadata']['name']} is not headless"
        assert svc["spec"].get("publishNotReadyAddresses", False) is False, "not-ready pods would get traffic"
        assert_serves(objs, svc, int(m.group(2)), role)
        assert all("targetPort" not in p or p["targetPort"] == p["port"] for p in svc["spec"]["ports"]), \
            "a headless Service does not remap ports"
    router_svc = find(objs, "Service", "pdserve-router")
    assert router_svc is not None and router_svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert {p["port"] for p in router_svc["spec"]["ports"]} == {8000, 50051}
    assert port_named(c, "http") == 8000 and port_named(c, "grpc") == 50051


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_prefill_reaches_the_kvstore_service(kustomization: str) -> None:
    objs = render(kustomization)
    w = workload_of(objs, "prefill")
    args = dict(a.split("=", 1) for a in service_container(w)["args"][1:])
    host, port = args["--kvstore-address"].rsplit(":", 1)
    assert_serves(objs, service_for(objs, host, namespace_of(w)), int(port), "kvstore")
    sts = workload_of(objs, "kvstore")
    assert sts["kind"] == "StatefulSet" and sts["spec"]["volumeClaimTemplates"], "kvstore: StatefulSet + PVC"
    assert find(objs, "Service", sts["spec"]["serviceName"]) is not None


@pytest.mark.parametrize("kustomization", [*KUSTOMIZATIONS, "overlays/gpu+mooncake"])
def test_disruption_budgets_cover_every_workload(kustomization: str) -> None:
    """Router, prefill, decode, kvstore (2 replicas with Mooncake Store) and mooncake-master: one budget
    each, evicting one pod at a time."""
    objs = render(kustomization)
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for w in workloads(objs):
        labels = w["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], labels)]
        name = w["metadata"]["name"]
        assert len(covering) == 1, f"{name}: {len(covering)} PodDisruptionBudgets"
        # minAvailable: 1 with one replica would block every node drain.
        assert covering[0]["spec"].get("maxUnavailable") == 1, f"{name}: use maxUnavailable: 1"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_prometheus_configs_select_every_pod(kustomization: str) -> None:
    monitor = yaml.safe_load((REPO / "deploy/prometheus/podmonitor.yaml").read_text())
    match = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]}
    for w in workloads(render(kustomization)):
        tmpl = w["spec"]["template"]
        # prometheus.yml keeps pods labelled app.kubernetes.io/part-of=pdserve with the scrape annotation.
        assert selects(match, tmpl["metadata"]["labels"]), f"{w['metadata']['name']}: PodMonitor misses it"
        for c in tmpl["spec"]["containers"]:
            assert ports <= {p.get("name") for p in c.get("ports", [])}, f"{w['metadata']['name']}/{c['name']}"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_referenced_claims_exist_or_are_templates(kustomization: str) -> None:
    objs = render(kustomization)
    for w in workloads(objs):
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for v in w["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                assert find(objs, "PersistentVolumeClaim", claim) is not None, f"{w['metadata']['name']}: {claim}"
        for c in w["spec"]["template"]["spec"]["containers"]:
            vols = {v["name"] for v in w["spec"]["template"]["spec"].get("volumes", [])} | templates
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{w['metadata']['name']}/{c['name']}: unknown volume {m['name']}"


# ---- overlays ----------------------------------------------------------------------------------------

def test_cpu_local_runs_one_of_each_on_cpu() -> None:
    objs = render("overlays/cpu-local")
    for component in COMPONENTS:
        w = workload_of(objs, component)
        assert w["spec"].get("replicas", 1) == 1, component
        for c in w["spec"]["template"]["spec"]["containers"]:
            assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), component
    require_parser("prefill")
    from services.engine.config import EngineConfig
    for component in ("prefill", "decode"):
        assert effective_config(objs, component)[EngineConfig].device == "cpu"


def test_gpu_overlay_puts_prefill_and_decode_on_gpus() -> None:
    from services.engine.config import EngineConfig

    objs = render("overlays/gpu")
    for component in ("prefill", "decode"):
        w = workload_of(objs, component)
        assert w["spec"]["replicas"] == 2, component
        pod = w["spec"]["template"]["spec"]
        c = service_container(w)
        assert str(c["resources"]["limits"].get("nvidia.com/gpu")) == "1", f"{component}: nvidia.com/gpu limit"
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), component
        assert pod.get("nodeSelector"), f"{component}: no GPU node selector"
        ecfg = effective_config(objs, component)[EngineConfig]
        assert ecfg.device.startswith("cuda"), f"{component}: device {ecfg.device}"
        assert ecfg.model and ecfg.model.startswith("/models/"), f"{component}: model {ecfg.model}"
        assert any(m["mountPath"] == "/models" for m in c["volumeMounts"]), component
    router = workload_of(objs, "router")
    rc = service_container(router)
    assert "nvidia.com/gpu" not in rc["resources"].get("limits", {}), "the router needs no GPU"
    assert any(m["mountPath"] == "/models" for m in rc.get("volumeMounts", [])), "router: tokenizer files"
    from services.router.config import RouterConfig
    assert effective_config(objs, "router")[RouterConfig].model == ecfg.model, "router and workers differ"


def test_mooncake_overlay_runs_a_master_and_the_mooncake_backend() -> None:
    objs = render("overlays/mooncake")
    master = find(objs, "Deployment", "pdserve-mooncake-master")
    assert master is not None
    mc = master["spec"]["template"]["spec"]["containers"][0]
    assert mc["command"] == ["mooncake_master"]
    rpc_port = port_named(mc, "rpc")
    margs = dict(a.lstrip("-").split("=", 1) for a in mc["args"])
    assert int(margs["rpc_port"]) == rpc_port and int(margs["metrics_port"]) == port_named(mc, "metrics")
    svc = find(objs, "Service", "pdserve-mooncake-master")
    assert svc is not None and selects(svc["spec"]["selector"], master["spec"]["template"]["metadata"]["labels"])
    assert rpc_port in {p["port"] for p in svc["spec"]["ports"]}

    kv = workload_of(objs, "kvstore")
    c = service_container(kv)
    args = dict(a.split("=", 1) for a in c["args"][1:])
    assert args["--backend"] == "mooncake"
    master_addr = [v for k, v in args.items() if "master" in k]
    assert master_addr == [f"pdserve-mooncake-master:{rpc_port}"], master_addr
    bind = next(e for e in c["env"] if e["name"] == "MC_TCP_BIND_ADDRESS")
    assert bind["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


# ---- mTLS ----------------------------------------------------------------------------------------------

# Every kustomization runs mTLS between the services; plaintext only with the component that asks for it.
MTLS = (*KUSTOMIZATIONS, "overlays/gpu+mooncake", "overlays/cpu-local+cert-manager")
PLAINTEXT = ("overlays/cpu-local+insecure-internal", "overlays/gpu+mooncake+insecure-internal")


@pytest.mark.parametrize("kustomization", MTLS)
@pytest.mark.parametrize("component", COMPONENTS)
def test_mtls_runs_every_service_with_its_roles_certificate(kustomization: str, component: str) -> None:
    objs, w, c = pod(kustomization, component)
    env, _ = container_env(objs, w, c)
    require_parser(component)
    server = server_config(effective_config(objs, component))
    assert server.tls_enabled, f"{kustomization}: {component} runs without TLS"
    assert not server.insecure_internal, f"{kustomization}: {component} allows plaintext"
    files = {"PDSERVE_TLS_CERT": "tls.crt", "PDSERVE_TLS_KEY": "tls.key", "PDSERVE_TLS_CA": "ca.crt"}
    for var, key in files.items():
        assert mounted_secret(w, c, env[var]) == (f"pdserve-tls-{component}", key), f"{component}: {var}"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert_health_exec_probe(w, c, env, probe, server.port)


@pytest.mark.parametrize("kustomization", MTLS)
def test_mtls_router_key_and_service_protocols(kustomization: str) -> None:
    objs, w, c = pod(kustomization, "router")
    env, _ = container_env(objs, w, c)
    if kustomization == "overlays/api-key":
        assert mounted_secret(w, c, env["PDSERVE_API_KEY_FILE"]) == ("pdserve-api-key", "api-key")
    assert "PDSERVE_API_KEY" not in env, "the key itself must not sit in the manifest"
    for svc in (o for o in objs if o["kind"] == "Service"):
        for port in svc["spec"]["ports"]:
            assert port.get("appProtocol") != "kubernetes.io/h2c", f"{svc['metadata']['name']}: h2c under TLS"


def test_mtls_combines_with_the_gpu_overlay_and_mooncake() -> None:
    objs = render("overlays/gpu+mooncake")
    errors = validation_errors(objs)
    assert not errors, "\n".join(errors)
    for component in ("prefill", "decode"):
        startup = service_container(workload_of(objs, component))["startupProbe"]
        assert (startup["periodSeconds"], startup["failureThreshold"]) == (10, 180), f"{component}: gpu timing lost"
    assert find(objs, "Deployment", "pdserve-mooncake-master") is not None


def test_cert_manager_issues_the_secret_every_role_mounts() -> None:
    """components/cert-manager: one Certificate per role into the Secret that role's pods mount, CN = the
    role, the SAN clients verify servers against, server and client auth, from a CA Issuer whose CA is
    issued by an Issuer of the same namespace."""
    from services.common.tls import DEFAULT_SERVER_NAME

    objs = render("overlays/cpu-local+cert-manager")
    errors = validation_errors(objs)
    assert not errors, "\n".join(errors)
    certs = {o["spec"]["secretName"]: o for o in objs if o["kind"] == "Certificate"}
    issuers = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Issuer"}
    assert {namespace_of(o) for o in (*certs.values(), *issuers.values())} == {"pdserve"}
    for component in COMPONENTS:
        _, w, c = pod("overlays/cpu-local+cert-manager", component)
        env, _ = container_env(objs, w, c)
        secret, _ = mounted_secret(w, c, env["PDSERVE_TLS_CERT"])
        cert = certs.pop(secret)["spec"]
        assert cert["commonName"] == component, f"{secret}: CN {cert['commonName']} is not the role"
        assert DEFAULT_SERVER_NAME in cert["dnsNames"], f"{secret}: no SAN {DEFAULT_SERVER_NAME}"
        assert {"server auth", "client auth"} <= set(cert["usages"]), f"{secret}: usages {cert['usages']}"
        assert not cert.get("isCA"), secret
        issuer = issuers[cert["issuerRef"]["name"]]["spec"]
        ca = certs[issuer["ca"]["secretName"]]["spec"]  # the CA Issuer's key pair is a Certificate here
        assert ca["isCA"] is True and "selfSigned" in issuers[ca["issuerRef"]["name"]]["spec"]
    assert set(certs) == {"pdserve-ca"}, f"Certificates nothing mounts: {sorted(certs)}"


@pytest.mark.parametrize("kustomization", PLAINTEXT)
@pytest.mark.parametrize("component", COMPONENTS)
def test_plaintext_only_with_the_insecure_internal_component(kustomization: str, component: str) -> None:
    """components/insecure-internal: the service is told plaintext is wanted (it would refuse a non-loopback
    bind without TLS otherwise), carries no certificate, and the kubelet's grpc: probe checks it."""
    objs, w, c = pod(kustomization, component)
    errors = validation_errors(objs)
    assert not errors, "\n".join(errors)
    require_parser(component)
    server = server_config(effective_config(objs, component))
    assert not server.tls_enabled and server.insecure_internal, f"{kustomization}: {component}"
    env, _ = container_env(objs, w, c)
    assert not [k for k in env if k.startswith("PDSERVE_TLS_")], f"{component}: certificate env left behind"
    vols = w["spec"]["template"]["spec"]["volumes"]
    assert not [v for v in vols if "secret" in v and v["secret"]["secretName"].startswith("pdserve-tls-")]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe].get("grpc", {}).get("port") == server.port and "exec" not in c[probe], f"{component}: {probe}"
