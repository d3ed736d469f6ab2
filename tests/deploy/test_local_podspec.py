"""deploy/local/podspec.py: the cpu-local render becomes the same pods a cluster would run (images,
args with $(VAR) expanded, env from ConfigMaps and the downward API, probes, security context, limits),
every name the manifests use resolves to the right pod, and what the mapping cannot reproduce fails
loudly. No containers: only `kubectl kustomize`."""

from __future__ import annotations

import importlib.util
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OVERLAY = REPO / "deploy" / "k8s" / "overlays" / "cpu-local"

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None,
                                reason="kubectl not on PATH: `kubectl kustomize` renders the overlay")


def _load_podspec() -> Any:
    spec = importlib.util.spec_from_file_location("podspec", REPO / "deploy" / "local" / "podspec.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["podspec"] = mod
    spec.loader.exec_module(mod)
    return mod


podspec = _load_podspec()


def render(overlay: Path = OVERLAY) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


SECRETS = "/run/pdserve-secrets"


def make_plan(objs: list[dict[str, Any]], host_cpus: int = 8, secrets_dir: str | None = SECRETS) -> list[Any]:
    return podspec.plan(objs, network="net", subnet="10.9.8.0/24", cli="podman", host_cpus=host_cpus,
                        namespace="pdserve", secrets_dir=secrets_dir)


def hosts_of(c: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in c.run_flags:
        if f.startswith("--add-host="):
            name, ip = f.removeprefix("--add-host=").rsplit(":", 1)
            out.setdefault(name, set()).add(ip)
    return out


def manifest_container(objs: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    kind, name = workload.split("/")
    w = next(o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name)
    return w["spec"]["template"]["spec"]["containers"][0]


def test_one_pod_per_replica_with_the_manifest_image_args_and_probes() -> None:
    objs = render()
    pods = make_plan(objs)
    assert sorted(p.name for p in pods) == ["pdserve-decode-0", "pdserve-kvstore-0", "pdserve-prefill-0",
                                            "pdserve-router-0"]
    assert len({p.ip for p in pods}) == 4 and all(p.ip.startswith("10.9.8.") for p in pods)
    for p in pods:
        (c,) = p.containers
        m = manifest_container(objs, p.workload)
        assert c.name == p.name and c.image == m["image"] == "pdserve:dev"
        assert c.entrypoint == ()   # the image's ENTRYPOINT, as in the manifests (no `command:`)
        expected = [a.replace("$(POD_NAME)", p.name).replace("$(POD_NAMESPACE)", "pdserve") for a in m["args"]]
        assert list(c.args) == expected and not any("$(" in a for a in c.args)
        assert dict(c.ports) == {q["name"]: q["containerPort"] for q in m["ports"]}
        for kind, probe in c.probes:
            declared = m[f"{kind}Probe"]
            # `pdserve health` over mTLS inside the container, against its own gRPC port.
            assert probe.kind == "exec" and list(probe.command) == declared["exec"]["command"]
            assert probe.command[-1] == f"--address=127.0.0.1:{dict(c.ports)['grpc']}"
            assert probe.timeout_s == declared["timeoutSeconds"]
            assert probe.period_s == declared["periodSeconds"]
            assert probe.failure_threshold == declared["failureThreshold"]
        assert sorted(k for k, _ in c.probes) == ["liveness", "readiness", "startup"]
        assert p.grace_s == 60 and "--stop-timeout=60" in c.run_flags
        for flag in ("--user=10001:10001", "--group-add=10001", "--read-only", "--cap-drop=ALL",
                     "--security-opt=no-new-privileges"):
            assert flag in c.run_flags, (p.name, flag)
        assert any(f.startswith("--tmpfs=/tmp:") for f in c.run_flags)
    router = next(p for p in pods if p.name == "pdserve-router-0")
    assert router.containers[0].pre_stop == ("sleep", "5")


def test_env_comes_from_configmaps_and_the_downward_api() -> None:
    objs = render()
    pods = {p.name: p for p in make_plan(objs)}
    router = dict(pods["pdserve-router-0"].containers[0].env)
    assert router["POD_NAME"] == "pdserve-router-0" and router["POD_NAMESPACE"] == "pdserve"
    assert router["PDSERVE_METRICS_PORT"] == "9090" and router["PDSERVE_MODEL"] == ""
    decode = dict(pods["pdserve-decode-0"].containers[0].env)
    assert decode["PDSERVE_KV_CACHE_BYTES"] == "134217728"   # the overlay's merge wins over the base
    limit = manifest_container(objs, "Deployment/pdserve-decode")["resources"]["limits"]["cpu"]
    assert decode["OMP_NUM_THREADS"] == str(math.ceil(podspec.quantity(limit)))
    assert "--cpus=2" in pods["pdserve-decode-0"].containers[0].run_flags
    assert "--cpus=1" in make_plan(objs, host_cpus=1)[0].containers[0].run_flags   # capped at the host


def test_every_name_the_manifests_use_resolves_to_the_pod_behind_it() -> None:
    pods = make_plan(render())
    by_component = {dict(p.labels)["app.kubernetes.io/component"]: p for p in pods}
    checked = []
    for p in pods:
        hosts = hosts_of(p.containers[0])
        for arg in p.containers[0].args:
            target = arg.split("=", 1)[1] if arg.startswith(("--prefill=", "--decode=", "--kvstore-address=")) else ""
            if not target:
                continue
            host, port = target.removeprefix("dns:").rsplit(":", 1)
            component = arg[2:].split("=")[0].split("-")[0]
            backend = by_component[component]
            assert hosts[host] == {backend.ip}, (p.name, arg)
            assert int(port) == dict(backend.containers[0].ports)["grpc"]
            checked.append(arg)
    assert len(checked) == 3   # router --prefill/--decode, prefill --kvstore-address
    kv = hosts_of(pods[0].containers[0])
    assert kv["pdserve-kvstore-0.pdserve-kvstore-headless.pdserve.svc.cluster.local"] == {by_component["kvstore"].ip}


def test_pvc_template_becomes_a_group_owned_named_volume() -> None:
    kv = next(p for p in make_plan(render()) if p.name == "pdserve-kvstore-0")
    assert [(v.name, v.fs_group) for v in kv.volumes] == [("pages-pdserve-kvstore-0", 10001)]
    assert "--mount=type=volume,src=pages-pdserve-kvstore-0,dst=/var/lib/pdserve/kvstore" in kv.containers[0].run_flags


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "x", "B": "$(A)"}
    assert podspec.expand("$(A)-$$(A)-$(C)-$(B)", env) == "x-$(A)-$(C)-$(A)"


def test_what_the_mapping_cannot_reproduce_fails_loudly() -> None:
    objs = render()
    with pytest.raises(podspec.UnsupportedField, match="Job"):
        make_plan([*objs, {"kind": "Job", "metadata": {"name": "j"}}])
    bad = yaml.safe_load(yaml.safe_dump(objs))
    next(o for o in bad if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["stdin"] = True
    with pytest.raises(podspec.UnsupportedField, match="stdin"):
        make_plan(bad)
    remap = yaml.safe_load(yaml.safe_dump(objs))
    svc = next(o for o in remap if o["kind"] == "Service" and o["metadata"]["name"] == "pdserve-kvstore")
    svc["spec"]["ports"][0]["targetPort"] = 50999
    with pytest.raises(podspec.UnsupportedField, match="50999"):
        make_plan(remap)
    with pytest.raises(podspec.UnsupportedField, match="secret volume tls needs a secrets directory"):
        make_plan(objs, secrets_dir=None)
    items = yaml.safe_load(yaml.safe_dump(objs))
    w = next(o for o in items if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    next(v for v in w["volumes"] if v["name"] == "tls")["secret"]["items"] = [{"key": "tls.crt", "path": "c"}]
    with pytest.raises(podspec.UnsupportedField, match="items"):
        make_plan(items)


def test_secret_volumes_mount_their_directory_read_only_with_the_pods_group() -> None:
    """The base's certificate Secret of each role: a read-only bind of <secrets dir>/pdserve-tls-<role> at
    the manifest's mountPath, and the Secret (name, fsGroup, defaultMode) for pods.py to lay out."""
    for pod in make_plan(render()):
        role = dict(pod.labels)["app.kubernetes.io/component"]
        (c,) = pod.containers
        mounts = [f for f in c.run_flags if f.startswith("--mount=type=bind")]
        assert mounts == [f"--mount=type=bind,src={SECRETS}/pdserve-tls-{role},dst=/etc/pdserve/tls,ro"], mounts
        assert pod.secrets == (podspec.Secret(f"pdserve-tls-{role}", 10001, 0o440),)


@pytest.mark.parametrize("overlay", ["cpu-local", "gpu", "mooncake", "api-key", "monitoring", "autoscaling", "autoscaling-keda", "network-policy"])
def test_every_pod_of_an_overlay_runs_one_tagged_image(overlay: str) -> None:
    """Found running the mooncake overlay here: the base's `images:` did not reach the component's
    mooncake-master, which asked for `pdserve` (:latest) next to pdserve:0.1.0 everywhere else."""
    objs = render(OVERLAY.parent / overlay)
    images = {c["image"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert len(images) == 1, images
    assert ":" in next(iter(images)), images
