"""The image built for real and the cpu-local overlay's pods run for real, with podman (or docker):
deploy/local/run-pods.sh builds the image offline and starts router, prefill, decode and kvstore with the
manifests' images, args, env, ports and probes on a pod network (names resolved like the cluster's DNS).
Then: every declared probe passes against the running containers; a chat completion through the router
container is the engine's greedy answer (the same image running `pdserve generate`); SIGTERM to the
decode pod mid-request (the kubelet's pod deletion) turns it NOT_SERVING, the request still finishes
with the uninterrupted answer, and the container exits 0 within its terminationGracePeriodSeconds.

Skips, with the reason, when no container runtime can run containers here (`PDSERVE_CONTAINERS=1
scripts/install.sh` installs podman, runc and debootstrap and makes the base image) or when
PDSERVE_CONTAINERS=0. Timing on the 2-core dev box: base image ~35 s, wheelhouse ~30 s, image build
~4 min, pods ready ~40 s, tests ~1 min."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
RUN_PODS = REPO / "deploy" / "local" / "run-pods.sh"
IMAGE = "pdserve:dev"            # the cpu-local overlay's image
BASE_IMAGE = "pdserve-base:bookworm"
BUILD_TIMEOUT_S = 1500           # base image + wheelhouse + image build on 2 busy cores (measured ~5 min)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.containers, pytest.mark.timeout(2400)]


def container_env() -> tuple[str | None, dict[str, str], str]:
    """(cli, env for it, why not) from deploy/local/container-cli.sh, the same selection run-pods.sh makes."""
    if os.environ.get("PDSERVE_CONTAINERS") == "0":
        return None, {}, "PDSERVE_CONTAINERS=0"
    if shutil.which("kubectl") is None:
        return None, {}, "kubectl not on PATH: `kubectl kustomize` renders the overlay"
    proc = subprocess.run(["bash", "-c", f"source {REPO}/deploy/local/container-cli.sh && env -0"],
                          capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None, {}, (f"no container runtime ({proc.stderr.strip()}): `PDSERVE_CONTAINERS=1 scripts/install.sh` "
                          "installs podman, runc and debootstrap and makes the base image")
    env = dict(kv.split("=", 1) for kv in proc.stdout.split("\0") if "=" in kv)
    return env["CLI"], env, ""


CLI, ENV, WHY_NOT = container_env()


def sh(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=ENV, cwd=REPO)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def can_run_containers() -> str:
    """'' when a container starts here, else why not (the reason the tests skip with)."""
    assert CLI is not None
    if sh(CLI, "info", timeout=60, check=False).returncode != 0:
        return f"`{CLI} info` fails: the runtime cannot run containers here"
    if sh(CLI, "image", "inspect", BASE_IMAGE, timeout=60, check=False).returncode != 0:
        if shutil.which("debootstrap") is None or os.geteuid() != 0:
            return (f"no base image {BASE_IMAGE} and no way to make one (scripts/make-base-image.sh needs "
                    "root and debootstrap)")
        sh("bash", "scripts/make-base-image.sh", timeout=900)
    trial = sh(CLI, "run", "--rm", "--pull=never", "--network=none", BASE_IMAGE, "true", timeout=120, check=False)
    if trial.returncode != 0:
        return f"{CLI} cannot start a container here: {trial.stderr.strip()[-500:]}"
    return ""


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if CLI is None:
        pytest.skip(WHY_NOT)
    why = can_run_containers()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    build = sh("bash", str(RUN_PODS), "build", timeout=BUILD_TIMEOUT_S)
    print(build.stdout.strip().splitlines()[-1], f"(fixture: {time.monotonic() - t0:.0f} s)")
    state_file = tmp_path_factory.mktemp("pods") / "state.json"
    try:
        t1 = time.monotonic()
        up = sh("bash", str(RUN_PODS), "up", "--state", str(state_file), timeout=900, check=False)
        print(up.stdout, f"(up: {time.monotonic() - t1:.0f} s)")
        if up.returncode != 0:
            pytest.fail(f"pods did not become ready:\n{up.stdout[-4000:]}\n{up.stderr[-6000:]}")
        yield json.loads(state_file.read_text())
    finally:
        sh("bash", str(RUN_PODS), "down", "--volumes", timeout=300, check=False)


def pod_ip(state: dict[str, Any], component: str) -> str:
    (pod,) = [p for p in state["pods"] if p["labels"]["app.kubernetes.io/component"] == component]
    return pod["ip"]


def chat(router_ip: str, prompt: str, max_tokens: int, *, stream: bool = False) -> urllib.request.Request:
    body = {"model": model_id(router_ip), "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    return urllib.request.Request(f"http://{router_ip}:8000/v1/chat/completions", json.dumps(body).encode(),
                                  {"content-type": "application/json"})


def model_id(router_ip: str) -> str:
    with urllib.request.urlopen(f"http://{router_ip}:8000/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def complete(router_ip: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    with urllib.request.urlopen(chat(router_ip, prompt, max_tokens), timeout=300) as r:
        assert r.status == 200
        return json.load(r)["choices"][0]


def health(ip: str, port: int) -> str:
    with grpc.insecure_channel(f"{ip}:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_every_declared_probe_passes_against_the_running_pods(pods: dict[str, Any]) -> None:
    proc = sh("bash", str(RUN_PODS), "probe", timeout=120, check=False)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stdout
    by_container: dict[str, set[str]] = {}
    for r in results:
        assert r["ok"] and r["seen"] == "SERVING", r
        assert r["target"].startswith("grpc:")
        by_container.setdefault(r["container"], set()).add(r["probe"])
    assert by_container == {p["name"]: {"startup", "readiness", "liveness"} for p in pods["pods"]}
    # The metrics port the Prometheus annotations name answers on every pod IP.
    for p in pods["pods"]:
        port = p["containers"][0]["ports"]["metrics"]
        with urllib.request.urlopen(f"http://{p['ip']}:{port}/metrics", timeout=10) as r:
            assert r.status == 200 and b"# TYPE" in r.read()


def test_chat_completion_through_the_router_pod_is_the_engines_greedy_answer(pods: dict[str, Any]) -> None:
    prompt = "What is the capital of France?"
    got = complete(pod_ip(pods, "router"), prompt, 24)
    # The reference: the same image's engine in one process (`pdserve generate`), same dtype and threads
    # as the decode pod (cpu-local: bfloat16, OMP_NUM_THREADS = its 2-CPU limit).
    ref = sh(CLI or "podman", "run", "--rm", "--pull=never", "--network=none", "--read-only", "--tmpfs=/tmp",
             "--env=OMP_NUM_THREADS=2", IMAGE, "services.cli", "generate", "--chat", "--dtype=bfloat16",
             "--max-tokens=24", f"--prompt={prompt}", timeout=600)
    assert got["message"]["content"] == ref.stdout.strip(), ref.stderr[-2000:]
    assert "Paris" in got["message"]["content"]
    assert got["finish_reason"] == "stop"


def test_sigterm_to_decode_mid_request_finishes_it_and_exits_zero_within_grace(pods: dict[str, Any]) -> None:
    router, decode = pod_ip(pods, "router"), pod_ip(pods, "decode")
    (decode_pod,) = [p for p in pods["pods"] if p["labels"]["app.kubernetes.io/component"] == "decode"]
    prompt, max_tokens = "Write a long story about a dragon who learns to read.", 96
    reference = complete(router, prompt, max_tokens)
    assert reference["finish_reason"] == "length"

    stopped: dict[str, Any] = {}
    statuses: list[str] = []

    def delete_pod() -> None:
        proc = sh("bash", str(RUN_PODS), "stop", decode_pod["name"], timeout=decode_pod["grace_s"] + 60,
                  check=False)
        stopped.update(json.loads(proc.stdout.strip().splitlines()[-1])[0])

    stopper = threading.Thread(target=delete_pod)
    text, finish, done, n = [], None, False, 0
    with urllib.request.urlopen(chat(router, prompt, max_tokens, stream=True), timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["delta"].get("content") or "")
            finish = choice["finish_reason"] or finish
            n += 1
            if n == 8:
                stopper.start()         # SIGTERM now; the stream is ~90 tokens from its end
            elif n > 8 and "NOT_SERVING" not in statuses:   # what the readiness probe sees meanwhile
                try:
                    statuses.append(health(decode, decode_pod["containers"][0]["ports"]["grpc"]))
                except grpc.RpcError as e:
                    statuses.append(e.code().name)
    stopper.join()
    assert done and finish == "length"
    assert "".join(text) == reference["message"]["content"]   # nothing lost or repeated by the drain
    assert "NOT_SERVING" in statuses, statuses                   # readiness fails: out of the endpoints
    assert stopped["exit_codes"] == {decode_pod["name"]: 0}, stopped
    assert stopped["seconds"] < decode_pod["grace_s"], stopped
