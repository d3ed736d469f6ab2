"""Runs the pods of a kustomize render on this host with podman or docker, the way a kubelet would:
same images, commands, args, env, ports and probes (mapping in podspec.py and docs/DEPLOY.md).

  pods.py up    [-k deploy/k8s/overlays/cpu-local]  # start every pod, wait for startup + readiness probes
  pods.py probe                                     # run every declared probe once against the pods
  pods.py stop POD                                  # preStop, SIGTERM, SIGKILL after the grace period
  pods.py down  [--volumes]                         # stop every pod the same way, remove them
  pods.py plan                                      # the `run` commands, shell-quoted

`up` writes a JSON state file (--state) naming every pod, its IP and ports; `stop`/`down` print each
container's exit code and how long it took to stop, as JSON on the last line.

Secrets: a Secret volume mounts <--secrets>/<secretName>, one file per key. `up` makes the base's
pdserve-tls-<role> Secrets (tls.crt, tls.key, ca.crt) from a fresh CA when they are missing, plus a
`client` certificate of that CA for calling the pods from the host (named in the state file); any other
Secret must already be there (e.g. <--secrets>/pdserve-api-key/api-key). `down` removes the directory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import probes
import yaml
from podspec import Container, Pod, Secret, plan

REPO = Path(__file__).resolve().parents[2]
LABEL = "io.pdserve.local"


def render(kustomization: str) -> list[dict]:
    proc = subprocess.run(["kubectl", "kustomize", kustomization], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(f"kubectl kustomize {kustomization} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def set_images(objs: list[dict], images: dict[str, str]) -> list[dict]:
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            for c in o["spec"]["template"]["spec"]["containers"]:
                c["image"] = images.get(c["image"].split(":", 1)[0], c["image"])
    return objs


def run(cli: str, *args: str, check: bool = True, timeout: float | None = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([cli, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{cli} {' '.join(args[:3])}... failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def run_command(cli: str, pod: Pod, c: Container, publish: list[str]) -> list[str]:
    cmd = [cli, "run", "--detach", "--pull=never", f"--name={c.name}", f"--label={LABEL}={pod.namespace}",
           *(f"--label={k}={v}" for k, v in pod.labels), *c.run_flags,
           *(f"--publish={p}" for p in publish), *(f"--env={k}={v}" for k, v in c.env)]
    if c.entrypoint:
        cmd.append(f"--entrypoint={c.entrypoint[0]}")
    return [*cmd, c.image, *c.entrypoint[1:], *c.args]


def running(cli: str, name: str) -> bool:
    proc = run(cli, "inspect", "--format", "{{.State.Running}}", name, check=False)
    return proc.stdout.strip() == "true"


def logs_tail(cli: str, name: str, lines: int = 40) -> str:
    proc = run(cli, "logs", "--tail", str(lines), name, check=False)
    return proc.stdout + proc.stderr


def remove_all(cli: str, pods: list[Pod]) -> None:
    """Remove this plan's containers and any other container an earlier run labelled as ours."""
    listed = run(cli, "ps", "--all", f"--filter=label={LABEL}", "--format={{.Names}}", check=False).stdout.split()
    for name in sorted({*listed, *(c.name for p in pods for c in p.containers)}):
        run(cli, "rm", "--force", name, check=False)


def ensure_network(cli: str, network: str, subnet: str) -> None:
    if run(cli, "network", "inspect", network, check=False).returncode != 0:
        run(cli, "network", "create", f"--subnet={subnet}", network)


def ensure_volume(cli: str, image: str, name: str, fs_group: int | None) -> None:
    """A named volume standing in for a PVC; fsGroup makes it group-owned and setgid, as the kubelet does."""
    if run(cli, "volume", "inspect", name, check=False).returncode != 0:
        run(cli, "volume", "create", name)
    if fs_group is not None:
        run(cli, "run", "--rm", "--pull=never", "--network=none", "--user=0", "--entrypoint=/bin/sh",
            f"--mount=type=volume,src={name},dst=/v", image, "-c", f"chgrp {fs_group} /v && chmod 2775 /v")


TLS_SECRET = "pdserve-tls-"


def ensure_secrets(root: Path, secrets: list[Secret]) -> dict[str, str]:
    """Fill <root>/<name> for every Secret the pods mount; returns the host-side client certificate files.

    pdserve-tls-<role> Secrets are made when missing (services.common.tls.make_certs: one CA, a certificate
    per role with CN = the role, as `pdserve certs` writes them); a Secret of another name must exist."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    certs = root / "_certs"
    wanted = {s.name: s for s in secrets}
    if any(n.startswith(TLS_SECRET) for n in wanted) and not (certs / "ca.pem").exists():
        sys.path.insert(0, str(REPO))   # the project's own CA code; needs `cryptography` on the host
        from services.common.tls import make_certs

        make_certs(certs)
    for name, sec in sorted(wanted.items()):
        d = root / name
        if name.startswith(TLS_SECRET):
            role = name.removeprefix(TLS_SECRET)
            if not (certs / f"{role}.pem").exists():
                sys.exit(f"secret {name}: no certificate for role {role!r} (roles: router, prefill, decode, kvstore)")
            d.mkdir(exist_ok=True)
            for key, src in (("tls.crt", f"{role}.pem"), ("tls.key", f"{role}-key.pem"), ("ca.crt", "ca.pem")):
                shutil.copyfile(certs / src, d / key)
        elif not d.is_dir() or not any(d.iterdir()):
            sys.exit(f"secret {name}: put its keys in {d}/ (one file per key) before `up`")
        _own(d, sec)
    return {"ca": str(certs / "ca.pem"), "cert": str(certs / "client.pem"), "key": str(certs / "client-key.pem")}


def _own(d: Path, sec: Secret) -> None:
    """As the kubelet lays out a Secret volume: files of defaultMode owned by group fsGroup. Without root
    (rootless runtimes) the files stay the user's and are made readable instead."""
    as_kubelet = os.geteuid() == 0 and sec.fs_group is not None
    for f in d.iterdir():
        if as_kubelet:
            os.chown(f, 0, sec.fs_group)
        os.chmod(f, sec.mode if as_kubelet else 0o444)
    if as_kubelet:
        os.chown(d, 0, sec.fs_group)
    os.chmod(d, 0o750 if as_kubelet else 0o755)


def wait_ready(cli: str, pod: Pod, c: Container) -> dict:
    """Startup probe until it passes (the kubelet's budget: period x failureThreshold), then readiness."""
    result: dict = {"container": c.name, "ip": pod.ip}
    start = time.monotonic()
    for kind in ("startup", "readiness"):
        probe = dict(c.probes).get(kind)
        if probe is None:
            continue
        ok, _, seen = probes.wait(probe, pod.ip, c.name, cli, alive=lambda: running(cli, c.name))
        result[kind] = seen
        if not ok:
            result["failed"] = kind
            result["logs"] = logs_tail(cli, c.name)
            break
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def stop_pod(cli: str, pod: Pod) -> dict:
    """Pod deletion: preStop hooks, then SIGTERM to every container, SIGKILL after what is left of
    terminationGracePeriodSeconds. Returns exit codes and the seconds it took."""
    start = time.monotonic()
    for c in pod.containers:
        if c.pre_stop[:1] == ("sleep",):
            time.sleep(float(c.pre_stop[1]))
        elif c.pre_stop[:1] == ("exec",):
            run(cli, "exec", c.name, *c.pre_stop[1:], check=False, timeout=pod.grace_s)
    left = max(1, round(pod.grace_s - (time.monotonic() - start)))
    for c in pod.containers:
        run(cli, "stop", f"--time={left}", c.name, check=False, timeout=left + 30)
    codes: dict[str, int | None] = {}   # None: no such container (never started, or removed)
    for c in pod.containers:
        proc = run(cli, "inspect", "--format", "{{.State.ExitCode}}", c.name, check=False)
        codes[c.name] = int(proc.stdout.strip()) if proc.returncode == 0 else None
    return {"pod": pod.name, "exit_codes": codes, "seconds": round(time.monotonic() - start, 1),
            "grace_s": pod.grace_s}


def cmd_up(a: argparse.Namespace, pods: list[Pod]) -> int:
    for image in sorted({c.image for p in pods for c in p.containers}):
        if run(a.cli, "image", "inspect", image, check=False).returncode != 0:
            sys.exit(f"image {image} not found: build it first (deploy/local/run-pods.sh build)")
    remove_all(a.cli, pods)   # an earlier run (maybe of another overlay) would hold names and IPs
    ensure_network(a.cli, a.network, a.subnet)
    for p in pods:
        for v in p.volumes:
            ensure_volume(a.cli, p.containers[0].image, v.name, v.fs_group)
    client = ensure_secrets(Path(a.secrets), [s for p in pods for s in p.secrets])
    publish = [x.split(":", 1) for x in a.publish]
    for p in pods:
        for c in p.containers:
            run(a.cli, *run_command(a.cli, p, c, [pub for pod, pub in publish if pod == p.name])[1:])
            print(f"started {c.name} ({p.workload}) at {p.ip}", flush=True)
    state = {"cli": a.cli, "network": a.network, "secrets": a.secrets, "client_tls": client, "pods": [
        {"name": p.name, "ip": p.ip, "workload": p.workload, "grace_s": p.grace_s, "labels": dict(p.labels),
         "containers": [{"name": c.name, "ports": dict(c.ports), "env": dict(c.env)} for c in p.containers]}
        for p in pods]}
    Path(a.state).write_text(json.dumps(state, indent=2))
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as ex:
        results = list(ex.map(lambda pc: wait_ready(a.cli, *pc), [(p, c) for p in pods for c in p.containers]))
    for r in results:
        status = f"FAILED {r['failed']} probe: {r.get(r['failed'])}" if "failed" in r else "ready"
        print(f"{r['container']:28s} {r['ip']:15s} {status} after {r['seconds']} s", flush=True)
        if "failed" in r:
            print(r["logs"], file=sys.stderr)
    print(json.dumps({"state": a.state, "ready": all("failed" not in r for r in results)}))
    return 0 if all("failed" not in r for r in results) else 1


def cmd_probe(a: argparse.Namespace, pods: list[Pod]) -> int:
    results = []
    for p in pods:
        for c in p.containers:
            for kind, probe in c.probes:
                ok, seen = probes.check(probe, p.ip, c.name, a.cli)
                target = f"{probe.kind}:{probe.port}{probe.path}" if probe.port else f"exec:{probe.command}"
                results.append({"container": c.name, "probe": kind, "target": target, "ok": ok, "seen": seen})
                print(f"{c.name:28s} {kind:9s} {target:24s} {'ok ' if ok else 'FAIL'} {seen}", flush=True)
    print(json.dumps(results))
    return 0 if all(r["ok"] for r in results) else 1


def cmd_stop(a: argparse.Namespace, pods: list[Pod]) -> int:
    chosen = [p for p in pods if p.name in a.pod] if a.pod else pods
    if a.pod and len(chosen) != len(set(a.pod)):
        sys.exit(f"unknown pod in {a.pod}; pods: {[p.name for p in pods]}")
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(chosen))) as ex:
        results = list(ex.map(lambda p: stop_pod(a.cli, p), chosen))
    for r in results:
        print(f"{r['pod']:28s} exit {r['exit_codes']} after {r['seconds']} s (grace {r['grace_s']} s)", flush=True)
    if a.command == "down":
        remove_all(a.cli, pods)
        for p in pods:
            for v in p.volumes if a.volumes else ():
                run(a.cli, "volume", "rm", "--force", v.name, check=False)
        run(a.cli, "network", "rm", a.network, check=False)
        shutil.rmtree(a.secrets, ignore_errors=True)   # the CA key and every pod's key
    print(json.dumps(results))
    allowed = (0, None) if a.command == "down" else (0,)
    return 0 if all(code in allowed for r in results for code in r["exit_codes"].values()) else 1


def cmd_plan(a: argparse.Namespace, pods: list[Pod]) -> int:
    publish = [x.split(":", 1) for x in a.publish]
    for p in pods:
        print(f"# {p.workload} -> pod {p.name} at {p.ip}, grace {p.grace_s} s")
        for c in p.containers:
            print(shlex.join(run_command(a.cli, p, c, [pub for pod, pub in publish if pod == p.name])))
            for kind, probe in c.probes:
                print(f"#   {kind}Probe: {dataclasses.asdict(probe)}")
            if c.pre_stop:
                print(f"#   preStop: {c.pre_stop}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=("up", "probe", "stop", "down", "plan"))
    ap.add_argument("pod", nargs="*", help="stop: the pods to stop (default: all)")
    ap.add_argument("-k", "--kustomization", default=str(REPO / "deploy/k8s/overlays/cpu-local"))
    ap.add_argument("--cli", default=os.environ.get("CLI", "podman"), help="podman or docker")
    ap.add_argument("--network", default="pdserve-local", help="the pod network (a user bridge network)")
    ap.add_argument("--subnet", default="10.213.64.0/24", help="its subnet; pods get .10, .11, ...")
    ap.add_argument("--state", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdserve-local-pods.json"))
    ap.add_argument("--secrets", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "pdserve-local-secrets"),
                    help="the directory Secret volumes mount from (<dir>/<secretName>/<key>)")
    ap.add_argument("--publish", action="append", default=[], metavar="POD:HOSTIP:HOSTPORT:PORT",
                    help="like kubectl port-forward: publish a pod's port on the host (repeatable)")
    ap.add_argument("--volumes", action="store_true", help="down: also remove the PVC volumes")
    ap.add_argument("--set-image", action="append", default=[], metavar="NAME=IMAGE",
                    help="like `kustomize edit set image`: containers whose image is NAME (any tag) run IMAGE")
    a = ap.parse_args(argv)
    objs = set_images(render(a.kustomization), dict(x.split("=", 1) for x in a.set_image))
    namespaces = {o["metadata"]["namespace"] for o in objs if "namespace" in o["metadata"]}
    pods = plan(objs, network=a.network, subnet=a.subnet, cli=os.path.basename(a.cli),
                namespace=next(iter(namespaces)) if len(namespaces) == 1 else "default",
                secrets_dir=os.path.abspath(a.secrets))
    handlers = {"up": cmd_up, "probe": cmd_probe, "stop": cmd_stop, "down": cmd_stop, "plan": cmd_plan}
    return handlers[a.command](a, pods)


if __name__ == "__main__":
    sys.exit(main())
