"""Kubernetes objects (a `kubectl kustomize` render) -> the pods one host's container runtime runs.

Pure translation, no containers: `plan(objects, ...)` returns every pod of every Deployment/StatefulSet
with the exact image, command, args, env, ports and probes of its manifest, and the runtime flags that
stand in for what a cluster does. Anything the mapping does not know fails loudly (UnsupportedField)
rather than being dropped silently. The mapping, object by object (docs/DEPLOY.md repeats it):

- Namespace: only a name, used in DNS names and in fieldRef metadata.namespace.
- Deployment/StatefulSet with N replicas: N pods named <workload>-<i> (a Deployment's real pods carry a
  ReplicaSet hash instead), each on a fixed IP of one user network (the pod IP).
- Service (ClusterIP or headless): /etc/hosts entries (--add-host) in every container mapping <svc>,
  <svc>.<ns>, <svc>.<ns>.svc and <svc>.<ns>.svc.<domain> to the IPs of every pod it selects: no virtual
  IP and no readiness gating; a port must equal its targetPort (hosts files cannot remap ports).
  StatefulSet pods also get <pod>.<serviceName>.<ns>.svc.<domain>.
- env: envFrom configMapRef, configMapKeyRef (from the rendered ConfigMaps), fieldRef (metadata.name,
  metadata.namespace, status.podIP, spec.nodeName), resourceFieldRef (rounded up like the kubelet);
  $(VAR) in env values, command and args expanded with Kubernetes' rules ($$ is a literal $).
- securityContext: runAsUser/runAsGroup -> --user, fsGroup -> --group-add and group-owned volumes,
  readOnlyRootFilesystem -> --read-only, drop ALL -> --cap-drop=ALL, allowPrivilegeEscalation false ->
  no-new-privileges; seccomp RuntimeDefault is the runtime's default profile.
- resources.limits: --cpus (capped at this host's CPUs) and --memory; requests only inform scheduling.
- volumes: emptyDir -> a tmpfs of its sizeLimit; a volumeClaimTemplate -> a named volume
  <claim>-<pod> (kept by `down` unless asked); a Secret -> a read-only bind mount of the directory
  <secrets dir>/<secretName>, one file per key (pods.py fills it: the pdserve-tls-<role> Secrets it makes
  with a fresh CA, others the user puts there), group-owned by fsGroup with the volume's defaultMode.
- probes, preStop and terminationGracePeriodSeconds: carried in the plan; pods.py runs the probes from
  the host against the pod IP like a kubelet, and preStop before SIGTERM with the grace period.
Not mapped (scheduling only): PodDisruptionBudgets, topology spread, requests, rolling-update strategy;
no restarts on liveness failure.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
from typing import Any

Obj = dict[str, Any]
CLUSTER_DOMAIN = "cluster.local"
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# Kinds with no local counterpart beyond what plan() derives from the others.
PASSIVE_KINDS = ("Namespace", "ConfigMap", "Service", "PodDisruptionBudget")


class UnsupportedField(ValueError):
    """A manifest uses something this local mapping does not reproduce."""


@dataclasses.dataclass(frozen=True)
class Probe:
    kind: str                  # "grpc" | "http" | "tcp" | "exec"
    port: int | None
    path: str                  # httpGet path
    service: str               # grpc.health.v1 service name ("" = overall)
    command: tuple[str, ...]   # exec
    initial_delay_s: float
    period_s: float
    timeout_s: float
    failure_threshold: int


@dataclasses.dataclass(frozen=True)
class Container:
    name: str                      # runtime container name (the pod name for a pod's first container)
    image: str
    entrypoint: tuple[str, ...]    # the manifest's command ((): the image's ENTRYPOINT)
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    ports: tuple[tuple[str, int], ...]   # (name, containerPort)
    run_flags: tuple[str, ...]     # runtime flags for `run` (security, resources, mounts, network)
    probes: tuple[tuple[str, Probe], ...]   # ("startup" | "readiness" | "liveness", probe)
    pre_stop: tuple[str, ...]      # ("sleep", seconds) | ("exec", *command) | ()


@dataclasses.dataclass(frozen=True)
class Volume:
    name: str        # runtime volume name
    fs_group: int | None


@dataclasses.dataclass(frozen=True)
class Secret:
    name: str        # the Secret's name: the directory <secrets dir>/<name>
    fs_group: int | None
    mode: int        # the volume's defaultMode (the kubelet's default 0644)


@dataclasses.dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    workload: str
    labels: tuple[tuple[str, str], ...]
    ip: str
    grace_s: int
    containers: tuple[Container, ...]
    volumes: tuple[Volume, ...]
    secrets: tuple[Secret, ...] = ()


_POD_SPEC_KEYS = {"containers", "volumes", "securityContext", "terminationGracePeriodSeconds",
                  "automountServiceAccountToken", "topologySpreadConstraints", "nodeSelector",
                  "tolerations", "affinity", "restartPolicy", "dnsPolicy"}
_CONTAINER_KEYS = {"name", "image", "command", "args", "env", "envFrom", "ports", "resources",
                   "securityContext", "volumeMounts", "startupProbe", "readinessProbe", "livenessProbe",
                   "lifecycle", "imagePullPolicy", "terminationMessagePolicy", "workingDir"}


def _check_keys(where: str, obj: Obj, allowed: set[str]) -> None:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise UnsupportedField(f"{where}: {', '.join(unknown)} not mapped to the local runtime")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes $(VAR) expansion: known names are replaced, unknown ones kept, $$ is a literal $."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", sub, value)


_QUANTITY = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def quantity(q: str | int | float) -> float:
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    if not m or m.group(2) not in _QUANTITY:
        raise UnsupportedField(f"quantity {q!r}")
    return float(m.group(1)) * _QUANTITY[m.group(2)]


def _config_maps(objs: list[Obj]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: {k: str(v) for k, v in (o.get("data") or {}).items()}
            for o in objs if o["kind"] == "ConfigMap"}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _env(c: Obj, pod: str, ns: str, ip: str, cms: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom") or []:
        if set(src) - {"configMapRef", "prefix"}:
            raise UnsupportedField(f"{pod}/{c['name']}: envFrom {sorted(src)}")
        env.update({src.get("prefix", "") + k: v for k, v in cms[src["configMapRef"]["name"]].items()})
    fields = {"metadata.name": pod, "metadata.namespace": ns, "status.podIP": ip,
              "spec.nodeName": os.uname().nodename}
    limits = (c.get("resources") or {}).get("limits") or {}
    requests = (c.get("resources") or {}).get("requests") or {}
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
            continue
        ref = e.get("valueFrom") or {}
        if "fieldRef" in ref:
            path = ref["fieldRef"]["fieldPath"]
            if path not in fields:
                raise UnsupportedField(f"{pod}: fieldRef {path}")
            env[e["name"]] = fields[path]
        elif "resourceFieldRef" in ref:
            r = ref["resourceFieldRef"]
            kind, _, res = r["resource"].partition(".")
            amount = (limits if kind == "limits" else requests).get(res)
            if amount is None:
                raise UnsupportedField(f"{pod}: resourceFieldRef {r['resource']} without a value")
            env[e["name"]] = str(math.ceil(quantity(amount) / quantity(r.get("divisor", "1"))))
        elif "configMapKeyRef" in ref:
            r = ref["configMapKeyRef"]
            env[e["name"]] = cms[r["name"]][r["key"]]
        else:
            raise UnsupportedField(f"{pod}: env {e['name']} valueFrom {sorted(ref)}")
    return env


def _probe(p: Obj, ports: dict[str, int]) -> Probe:
    """A probe with its port resolved: a named port (`port: metrics`) is the container's port of that name."""
    def port(v: int | str) -> int:
        if isinstance(v, str) and not v.isdigit():
            if v not in ports:
                raise UnsupportedField(f"probe port {v!r} names no containerPort")
            return ports[v]
        return int(v)
    common = dict(initial_delay_s=float(p.get("initialDelaySeconds", 0)),
                  period_s=float(p.get("periodSeconds", 10)), timeout_s=float(p.get("timeoutSeconds", 1)),
                  failure_threshold=int(p.get("failureThreshold", 3)))
    if "grpc" in p:
        return Probe("grpc", port(p["grpc"]["port"]), "", p["grpc"].get("service", ""), (), **common)
    if "httpGet" in p:
        if p["httpGet"].get("scheme", "HTTP") != "HTTP" or p["httpGet"].get("host"):
            raise UnsupportedField(f"httpGet {p['httpGet']}")
        return Probe("http", port(p["httpGet"]["port"]), p["httpGet"].get("path", "/"), "", (), **common)
    if "tcpSocket" in p:
        return Probe("tcp", port(p["tcpSocket"]["port"]), "", "", (), **common)
    if "exec" in p:
        return Probe("exec", None, "", "", tuple(p["exec"]["command"]), **common)
    raise UnsupportedField(f"probe {sorted(p)}")


def _security_flags(pod_sc: Obj, sc: Obj, cli: str) -> list[str]:
    merged = {**pod_sc, **sc}
    flags: list[str] = []
    if "runAsUser" in merged:
        flags.append(f"--user={merged['runAsUser']}:{merged.get('runAsGroup', merged['runAsUser'])}")
    if merged.get("runAsNonRoot") and int(merged.get("runAsUser", 0)) == 0:
        raise UnsupportedField("runAsNonRoot without a non-zero runAsUser")
    if "fsGroup" in pod_sc:
        flags.append(f"--group-add={pod_sc['fsGroup']}")
    if merged.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
        if cli == "podman":   # podman otherwise adds writable tmpfs mounts Kubernetes does not
            flags.append("--read-only-tmpfs=false")
    if "ALL" in ((merged.get("capabilities") or {}).get("drop") or []):
        flags.append("--cap-drop=ALL")
    for cap in (merged.get("capabilities") or {}).get("add") or []:
        flags.append(f"--cap-add={cap}")
    if merged.get("allowPrivilegeEscalation") is False:
        flags.append("--security-opt=no-new-privileges")
    if (merged.get("seccompProfile") or {}).get("type", "RuntimeDefault") != "RuntimeDefault":
        raise UnsupportedField(f"seccompProfile {merged['seccompProfile']}")
    return flags


_SECRET_KEYS = {"secretName", "defaultMode", "optional"}


def _secrets(spec: Obj, pod: str, fs_group: int | None) -> tuple[Secret, ...]:
    """The pod's Secret volumes (keys other than secretName/defaultMode, items: say, are refused)."""
    out = []
    for v in spec.get("volumes") or []:
        if "secret" in v:
            _check_keys(f"{pod}: secret volume {v['name']}", v["secret"], _SECRET_KEYS)
            if v["secret"].get("optional"):
                raise UnsupportedField(f"{pod}: secret volume {v['name']}: optional (the local runner always mounts)")
            out.append(Secret(v["secret"]["secretName"], fs_group, int(v["secret"].get("defaultMode", 0o644))))
    return tuple(out)


def _volume_flags(spec: Obj, c: Obj, pod: str, claims: set[str], secrets_dir: str | None) -> list[str]:
    vols = {v["name"]: v for v in spec.get("volumes") or []}
    flags: list[str] = []
    for m in c.get("volumeMounts") or []:
        ro = ",ro" if m.get("readOnly") else ""
        if m["name"] in claims:
            flags.append(f"--mount=type=volume,src={m['name']}-{pod},dst={m['mountPath']}{ro}")
            continue
        v = vols.get(m["name"])
        if v is not None and "secret" in v:
            if secrets_dir is None:
                raise UnsupportedField(f"{pod}: secret volume {m['name']} needs a secrets directory (secrets_dir)")
            if set(m) - {"name", "mountPath", "readOnly"}:
                raise UnsupportedField(f"{pod}: mount of secret {m['name']} ({sorted(m)})")
            src = os.path.join(secrets_dir, v["secret"]["secretName"])
            flags.append(f"--mount=type=bind,src={src},dst={m['mountPath']},ro")   # Secret volumes are read-only
            continue
        if v is None or "emptyDir" not in v:
            raise UnsupportedField(f"{pod}: volume {m['name']} ({sorted(v or {})})")
        size = (v["emptyDir"] or {}).get("sizeLimit")
        opts = f"rw,mode=1777{f',size={int(quantity(size))}' if size else ''}"
        flags.append(f"--tmpfs={m['mountPath']}:{opts}")
    return flags


def _resource_flags(c: Obj, host_cpus: int) -> list[str]:
    limits = (c.get("resources") or {}).get("limits") or {}
    flags = []
    if "cpu" in limits:
        flags.append(f"--cpus={min(quantity(limits['cpu']), float(host_cpus)):g}")
    if "memory" in limits:
        flags.append(f"--memory={int(quantity(limits['memory']))}")
    return flags


def _pre_stop(c: Obj) -> tuple[str, ...]:
    hook = ((c.get("lifecycle") or {}).get("preStop")) or {}
    if "sleep" in hook:
        return ("sleep", str(hook["sleep"]["seconds"]))
    if "exec" in hook:
        return ("exec", *hook["exec"]["command"])
    if hook:
        raise UnsupportedField(f"preStop {sorted(hook)}")
    return ()


def _pod_names(w: Obj) -> list[str]:
    return [f"{w['metadata']['name']}-{i}" for i in range(int(w["spec"].get("replicas", 1)))]


def host_entries(objs: list[Obj], ips: dict[str, str], ns_default: str) -> list[tuple[str, str]]:
    """(name, ip) for every Service name form and every StatefulSet pod's stable name."""
    pods = [(name, w) for w in objs if w["kind"] in WORKLOAD_KINDS for name in _pod_names(w)]
    entries: list[tuple[str, str]] = []
    for svc in (o for o in objs if o["kind"] == "Service"):
        ns = svc["metadata"].get("namespace", ns_default)
        for port in svc["spec"].get("ports") or []:
            target = port.get("targetPort", port["port"])
            if not isinstance(target, str) and int(target) != int(port["port"]):
                raise UnsupportedField(f"Service {svc['metadata']['name']}: port {port['port']} -> {target}")
        selector = svc["spec"].get("selector") or {}
        for name, w in pods:
            if selector and _selects(selector, w["spec"]["template"]["metadata"].get("labels") or {}):
                n = svc["metadata"]["name"]
                for host in (n, f"{n}.{ns}", f"{n}.{ns}.svc", f"{n}.{ns}.svc.{CLUSTER_DOMAIN}"):
                    entries.append((host, ips[name]))
    for name, w in pods:
        if w["kind"] == "StatefulSet" and w["spec"].get("serviceName"):
            ns = w["metadata"].get("namespace", ns_default)
            entries.append((f"{name}.{w['spec']['serviceName']}.{ns}.svc.{CLUSTER_DOMAIN}", ips[name]))
    return entries


def named_port_check(svc_ports: list[Obj], containers: list[Obj]) -> None:
    """A named targetPort must name a containerPort with the Service's port number."""
    by_name = {p["name"]: int(p["containerPort"]) for c in containers for p in c.get("ports") or [] if "name" in p}
    for port in svc_ports:
        t = port.get("targetPort")
        if isinstance(t, str) and t in by_name and by_name[t] != int(port["port"]):
            raise UnsupportedField(f"Service port {port['port']} -> named port {t}={by_name[t]}")


def plan(objs: list[Obj], *, network: str, subnet: str, cli: str = "podman",
         host_cpus: int | None = None, namespace: str = "default", secrets_dir: str | None = None) -> list[Pod]:
    """Every pod of the render, in manifest order, with its IP and the runtime flags for each container;
    Secret volumes mount <secrets_dir>/<secretName>."""
    host_cpus = host_cpus or os.cpu_count() or 1
    for o in objs:
        if o["kind"] not in WORKLOAD_KINDS + PASSIVE_KINDS:
            raise UnsupportedField(f"{o['kind']} {o['metadata']['name']}")
    cms = _config_maps(objs)
    workloads = [o for o in objs if o["kind"] in WORKLOAD_KINDS]
    hosts = ipaddress.ip_network(subnet).hosts()
    for _ in range(9):          # .1 is the gateway; pods start at .10
        next(hosts)
    ips = {name: str(next(hosts)) for w in workloads for name in _pod_names(w)}
    for svc in (o for o in objs if o["kind"] == "Service"):
        sel = svc["spec"].get("selector") or {}
        named_port_check(svc["spec"].get("ports") or [],
                         [c for w in workloads if _selects(sel, w["spec"]["template"]["metadata"].get("labels") or {})
                          for c in w["spec"]["template"]["spec"]["containers"]])
    add_hosts = tuple(f"--add-host={h}:{ip}" for h, ip in host_entries(objs, ips, namespace))
    pods: list[Pod] = []
    for w in workloads:
        ns = w["metadata"].get("namespace", namespace)
        spec = w["spec"]["template"]["spec"]
        _check_keys(f"{w['kind']} {w['metadata']['name']} pod spec", spec, _POD_SPEC_KEYS)
        claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates") or []}
        pod_sc = spec.get("securityContext") or {}
        labels = w["spec"]["template"]["metadata"].get("labels") or {}
        for name in _pod_names(w):
            containers = []
            for i, c in enumerate(spec["containers"]):
                _check_keys(f"{name}/{c['name']}", c, _CONTAINER_KEYS)
                env = _env(c, name, ns, ips[name], cms)
                cname = name if i == 0 else f"{name}-{c['name']}"
                net = ([f"--network={network}", f"--ip={ips[name]}", f"--hostname={name}", *add_hosts]
                       if i == 0 else [f"--network=container:{name}"])
                flags = [*net, *_security_flags(pod_sc, c.get("securityContext") or {}, cli),
                         *_resource_flags(c, host_cpus), *_volume_flags(spec, c, name, claims, secrets_dir),
                         f"--stop-timeout={int(spec.get('terminationGracePeriodSeconds', 30))}"]
                if c.get("workingDir"):
                    flags.append(f"--workdir={c['workingDir']}")
                ports = {q["name"]: int(q["containerPort"]) for q in c.get("ports") or [] if "name" in q}
                containers.append(Container(
                    name=cname, image=c["image"],
                    entrypoint=tuple(expand(a, env) for a in c.get("command") or []),
                    args=tuple(expand(a, env) for a in c.get("args") or []),
                    env=tuple(env.items()),
                    ports=tuple((p.get("name", ""), int(p["containerPort"])) for p in c.get("ports") or []),
                    run_flags=tuple(flags),
                    probes=tuple((k.removesuffix("Probe"), _probe(c[k], ports))
                                 for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c),
                    pre_stop=_pre_stop(c)))
            pods.append(Pod(
                name=name, namespace=ns, workload=f"{w['kind']}/{w['metadata']['name']}",
                labels=tuple(labels.items()), ip=ips[name],
                grace_s=int(spec.get("terminationGracePeriodSeconds", 30)), containers=tuple(containers),
                volumes=tuple(Volume(f"{claim}-{name}", pod_sc.get("fsGroup")) for claim in sorted(claims)),
                secrets=_secrets(spec, name, pod_sc.get("fsGroup"))))
    return pods
