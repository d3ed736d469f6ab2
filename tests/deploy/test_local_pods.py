"""The image built for real and the overlays' pods run for real, with podman (or docker):
deploy/local/run-pods.sh builds the image offline and starts the pods of an overlay with the manifests'
images, args, env, ports and probes on a pod network (names resolved like the cluster's DNS).
cpu-local: every declared probe (`pdserve health` over mTLS) passes against the running containers, and
each pod's gRPC port refuses a caller without a certificate of the pods' CA (run-pods.sh makes the base's
pdserve-tls-<role> Secrets); a chat completion
through the router container is the engine's greedy answer (the same image running `pdserve generate`; token for
token up to a near-tie of the served logprobs);
SIGTERM to the decode pod mid-request (the kubelet's pod deletion) turns it NOT_SERVING, the request
still finishes with the uninterrupted answer (every token once; the reference's up to a near-tie of its
logprobs), and the container exits 0 within its grace period.
mooncake: the master's tcpSocket and httpGet probes and every gRPC probe pass, and the answer is the same.

Skips, with the reason, when no container runtime can run containers here (`PDSERVE_CONTAINERS=1
scripts/install.sh` installs podman, runc and debootstrap and makes the base image) or when
PDSERVE_CONTAINERS=0. Timing on the 2-core dev box (busy): base image 35-110 s, wheelhouse 30-45 s,
image build 3.5-6 min cold, each overlay ready in ~35 s, the tests ~2 min."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import DEFAULT_SERVER_NAME

REPO = Path(__file__).resolve().parents[2]
RUN_PODS = REPO / "deploy" / "local" / "run-pods.sh"
IMAGE = "pdserve:dev"            # the cpu-local overlay's image
BASE_IMAGE = "pdserve-base:bookworm"
BUILD_TIMEOUT_S = 1500           # base image + wheelhouse + image build on 2 busy cores (measured 4-9 min)
PROMPT, MAX_TOKENS = "What is the capital of France?", 24

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
    info = sh(CLI, "info", timeout=60, check=False)
    if info.returncode != 0:
        return f"`{CLI} info` fails, the runtime cannot run containers here: {info.stderr.strip()[-300:]}"
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
def image() -> str:
    """The image, built offline by run-pods.sh (base image if missing, wheelhouse, `<cli> build`)."""
    if CLI is None:
        pytest.skip(WHY_NOT)
    why = can_run_containers()
    if why:
        pytest.skip(why)
    t0 = time.monotonic()
    build = sh("bash", str(RUN_PODS), "build", timeout=BUILD_TIMEOUT_S)
    print(build.stdout.strip().splitlines()[-1], f"(fixture: {time.monotonic() - t0:.0f} s)")
    return IMAGE


def run_overlay(overlay: str, state_file: Path) -> Iterator[dict[str, Any]]:
    """`run-pods.sh up` for an overlay (its pdserve image replaced by IMAGE); `down --volumes` after."""
    env = {"PDSERVE_OVERLAY": f"deploy/k8s/overlays/{overlay}", "PDSERVE_IMAGE": IMAGE}
    try:
        t1 = time.monotonic()
        up = sh("env", *(f"{k}={v}" for k, v in env.items()), "bash", str(RUN_PODS), "up",
                "--state", str(state_file), timeout=900, check=False)
        print(up.stdout, f"({overlay} up: {time.monotonic() - t1:.0f} s)")
        if up.returncode != 0:
            pytest.fail(f"{overlay} pods did not become ready:\n{up.stdout[-4000:]}\n{up.stderr[-6000:]}")
        state = json.loads(state_file.read_text())
        state["env"] = env
        yield state
    finally:
        t2 = time.monotonic()
        down = sh("env", *(f"{k}={v}" for k, v in env.items()), "bash", str(RUN_PODS), "down", "--volumes",
                  timeout=300, check=False)
        print(down.stdout, down.stderr[-2000:], f"({overlay} down: {time.monotonic() - t2:.0f} s)")
    # Every pod, deleted the kubelet's way, drained and exited 0 within its grace period.
    assert down.returncode == 0, down.stdout


@pytest.fixture(scope="class")
def pods(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield from run_overlay("cpu-local", tmp_path_factory.mktemp("cpu-local") / "state.json")


@pytest.fixture(scope="class")
def mooncake_pods(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    yield from run_overlay("mooncake", tmp_path_factory.mktemp("mooncake") / "state.json")


@pytest.fixture(scope="module")
def greedy_answer(image: str) -> Callable[[dict[str, Any]], str]:
    """The engine's greedy answer to PROMPT for an overlay's decode pod: the same image's engine in one
    process (`pdserve generate`, bfloat16 like the pods) with as many torch threads as the pod's
    PDSERVE_CPU_THREADS (`pdserve generate` takes one per CPU of its affinity: --cpuset-cpus)."""
    answers: dict[int, str] = {}

    def answer(state: dict[str, Any]) -> str:
        (decode,) = [p for p in state["pods"] if p["labels"]["app.kubernetes.io/component"] == "decode"]
        threads = min(int(decode["containers"][0]["env"]["PDSERVE_CPU_THREADS"]), os.cpu_count() or 1)
        if threads not in answers:
            ref = sh(CLI or "podman", "run", "--rm", "--pull=never", "--network=none", "--read-only",
                     "--tmpfs=/tmp", f"--cpuset-cpus=0-{threads - 1}", image, "services.cli", "generate",
                     "--chat", "--dtype=bfloat16", f"--max-tokens={MAX_TOKENS}", f"--prompt={PROMPT}",
                     timeout=600)
            assert "Paris" in ref.stdout, ref.stderr[-2000:]
            answers[threads] = ref.stdout.strip()
        return answers[threads]
    return answer


def pod_ip(state: dict[str, Any], component: str) -> str:
    (pod,) = [p for p in state["pods"] if p["labels"]["app.kubernetes.io/component"] == component]
    return pod["ip"]


def chat(router_ip: str, prompt: str, max_tokens: int, *, stream: bool = False, top_logprobs: int = 0,
         ignore_eos: bool = False) -> urllib.request.Request:
    body: dict[str, Any] = {"model": model_id(router_ip), "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "temperature": 0, "stream": stream, "ignore_eos": ignore_eos}
    if top_logprobs:
        body |= {"logprobs": True, "top_logprobs": top_logprobs}
    return urllib.request.Request(f"http://{router_ip}:8000/v1/chat/completions", json.dumps(body).encode(),
                                  {"content-type": "application/json"})


def model_id(router_ip: str) -> str:
    with urllib.request.urlopen(f"http://{router_ip}:8000/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def complete(router_ip: str, prompt: str, max_tokens: int, *, top_logprobs: int = 0, ignore_eos: bool = False
             ) -> dict[str, Any]:
    with urllib.request.urlopen(chat(router_ip, prompt, max_tokens, top_logprobs=top_logprobs, ignore_eos=ignore_eos),
                                timeout=300) as r:
        assert r.status == 200
        return json.load(r)["choices"][0]


NEAR_TIE = 0.25
"""Top-2 logprob margin under which two runs of the bf16 model may choose differently. The stream's prefill
may read the prompt's first pages from the kvstore (the reference computed them) and compute only the rest,
which CPU GEMM and attention kernels may round differently in the last bits; a greedy choice that close can
flip, after which the two texts part (seen on CI's host, not on the dev box)."""


def same_until_near_tie(want: list[dict[str, Any]], got: list[dict[str, Any]]) -> int:
    """Chat logprobs entries of the reference and of another run: equal tokens position by position until one
    where the reference's two best are within NEAR_TIE and the other run took the runner-up (not comparable
    past it). Returns how many positions agreed."""
    for i, (w, g) in enumerate(zip(want, got, strict=True)):
        if w["token"] != g["token"]:
            top = w["top_logprobs"]
            assert (len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE
                    and g["token"] == top[1]["token"]), f"token {i}: {g} where the reference had {w}"
            return i
    return len(want)


def text_until_near_tie(want: str, got: list[dict[str, Any]]) -> int:
    """The served answer's tokens (chat logprobs entries with two alternatives) spell ``want`` (the engine's greedy
    text from another run) token by token until one where the served run's two best are within NEAR_TIE and
    ``want`` goes on with the runner-up (not comparable past it). Returns how many characters of ``want`` agreed."""
    at = 0
    for i, g in enumerate(got):
        if at == len(want):  # all of it spelled: what follows is the end-of-turn token, which no text shows
            break
        if want.startswith(g["token"], at):
            at += len(g["token"])
            continue
        top = g["top_logprobs"]
        assert (len(top) == 2 and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE
                and want.startswith(top[1]["token"], at)), f"token {i}: {g} where the engine went on {want[at:]!r}"
        return at
    return at


def health(state: dict[str, Any], ip: str, port: int, *, certified: bool = True) -> str:
    """grpc.health.v1 Check of a pod's port over TLS, with the `client` certificate pods.py made from the
    pods' CA (certified) or with none (a caller the pods must refuse)."""
    tls = state["client_tls"]
    ca = Path(tls["ca"]).read_bytes()
    creds = (grpc.ssl_channel_credentials(ca, Path(tls["key"]).read_bytes(), Path(tls["cert"]).read_bytes())
             if certified else grpc.ssl_channel_credentials(ca))
    options = [("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME)]
    with grpc.secure_channel(f"{ip}:{port}", creds, options=options) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def run_pods(state: dict[str, Any], *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """run-pods.sh for the overlay `state` came from; never fails by itself (the caller asserts)."""
    return sh("env", *(f"{k}={v}" for k, v in state["env"].items()), "bash", str(RUN_PODS), *args,
              timeout=timeout, check=False)


def probe_all(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every probe the manifests declare, once, against the running containers; all must pass."""
    proc = run_pods(state, "probe", timeout=120)
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and all(r["ok"] for r in results), proc.stdout
    by_container: dict[str, set[str]] = {}
    for r in results:
        by_container.setdefault(r["container"], set()).add(r["probe"])
    assert by_container == {p["name"]: {"startup", "readiness", "liveness"} for p in state["pods"]}
    return results


def test_the_build_leaves_no_untagged_image_behind(image: str) -> None:
    """A rebuild untags the image the tag pointed at, and a multi-stage build keeps its build stage (~6 GB
    a time together): run-pods.sh prunes the untagged ones of deploy/Dockerfile's label after building."""
    assert CLI is not None
    left = sh(CLI, "images", "-q", "--filter", "dangling=true", "--filter", "label=io.pdserve.image=1", timeout=60)
    assert left.stdout.split() == [], f"untagged pdserve images left after the build: {left.stdout.split()}"
    assert sh(CLI, "image", "inspect", image, timeout=60).returncode == 0


class TestCpuLocal:
    def test_every_declared_probe_passes_against_the_running_pods(self, pods: dict[str, Any]) -> None:
        for r in probe_all(pods):   # `pdserve health` over mTLS inside each container
            assert r["target"].startswith("exec:") and r["seen"].startswith("exit 0"), r
        # mTLS by default: each pod's gRPC port answers a certificate of the pods' CA, refuses a caller
        # without one, and speaks no plaintext.
        for p in pods["pods"]:
            port = p["containers"][0]["ports"]["grpc"]
            assert health(pods, p["ip"], port) == "SERVING", p["name"]
            with pytest.raises(grpc.RpcError) as refused:
                health(pods, p["ip"], port, certified=False)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, (p["name"], refused.value)
            with grpc.insecure_channel(f"{p['ip']}:{port}") as ch, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        # The metrics port the Prometheus annotations name answers on every pod IP.
        for p in pods["pods"]:
            port = p["containers"][0]["ports"]["metrics"]
            with urllib.request.urlopen(f"http://{p['ip']}:{port}/metrics", timeout=10) as r:
                assert r.status == 200 and b"# TYPE" in r.read()

    def test_chat_completion_through_the_router_pod_is_the_engines_greedy_answer(
            self, pods: dict[str, Any], greedy_answer: Callable[[dict[str, Any]], str]) -> None:
        got = complete(pod_ip(pods, "router"), PROMPT, MAX_TOKENS, top_logprobs=2)
        want = greedy_answer(pods)
        if text_until_near_tie(want, got["logprobs"]["content"]) == len(want):  # else parted at a near-tie
            assert got["message"]["content"] == want and got["finish_reason"] == "stop"

    def test_sigterm_to_decode_mid_request_finishes_it_and_exits_zero_within_grace(
            self, pods: dict[str, Any]) -> None:
        router, decode = pod_ip(pods, "router"), pod_ip(pods, "decode")
        (decode_pod,) = [p for p in pods["pods"] if p["labels"]["app.kubernetes.io/component"] == "decode"]
        # Long enough that the SIGTERM lands mid-stream on a busy host (`run-pods.sh stop` starts Python and podman
        # first: seconds when loaded), where 96 tokens were once over before it did.
        prompt, max_tokens = "Write a long story about a dragon who learns to read.", 256
        reference = complete(router, prompt, max_tokens, top_logprobs=2, ignore_eos=True)
        assert reference["finish_reason"] == "length"
        want = reference["logprobs"]["content"]
        assert len(want) == max_tokens

        stopped: dict[str, Any] = {}
        statuses: list[str] = []

        def delete_pod() -> None:   # the kubelet's pod deletion: SIGTERM, SIGKILL after the grace period
            proc = run_pods(pods, "stop", decode_pod["name"], timeout=decode_pod["grace_s"] + 60)
            stopped.update(json.loads(proc.stdout.strip().splitlines()[-1])[0])

        stopper = threading.Thread(target=delete_pod)
        text: list[str] = []
        got: list[dict[str, Any]] = []
        finish, done = None, False
        with urllib.request.urlopen(chat(router, prompt, max_tokens, stream=True, top_logprobs=2, ignore_eos=True),
                                    timeout=300) as r:
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
                got += (choice.get("logprobs") or {}).get("content") or []
                if len(got) >= 4 and stopper.ident is None:
                    stopper.start()         # SIGTERM now; the stream is ~250 tokens from its end
                elif stopper.ident is not None and "NOT_SERVING" not in statuses:   # what the readiness probe sees
                    try:
                        statuses.append(health(pods, decode, decode_pod["containers"][0]["ports"]["grpc"]))
                    except grpc.RpcError as e:
                        statuses.append(e.code().name)
        stopper.join()
        assert done and finish == "length"
        # Nothing lost or repeated by the drain: every token once, each the reference's (up to a near-tie).
        assert len(got) == max_tokens, [e["token"] for e in got]
        if same_until_near_tie(want, got) == max_tokens:
            assert "".join(text) == reference["message"]["content"]
        assert "NOT_SERVING" in statuses, statuses                   # readiness fails: out of the endpoints
        assert stopped["exit_codes"] == {decode_pod["name"]: 0}, stopped
        assert stopped["seconds"] < decode_pod["grace_s"], stopped


class TestMooncake:
    """The mooncake overlay: a mooncake_master pod (tcpSocket startup, httpGet /health readiness and
    liveness on its named ports) and two kvstore replicas on Mooncake Store, from the same image."""

    def test_http_tcp_and_grpc_probes_pass_and_the_answer_is_the_same(
            self, mooncake_pods: dict[str, Any], greedy_answer: Callable[[dict[str, Any]], str]) -> None:
        results = probe_all(mooncake_pods)
        master = {r["probe"]: r for r in results if "mooncake-master" in r["container"]}
        assert master["readiness"]["target"] == master["liveness"]["target"] == "http:9090/health"
        assert master["readiness"]["seen"] == "HTTP 200" and master["startup"]["target"] == "tcp:50051"
        assert sum(1 for p in mooncake_pods["pods"] if "kvstore" in p["name"]) == 2
        got = complete(pod_ip(mooncake_pods, "router"), PROMPT, MAX_TOKENS, top_logprobs=2)
        want = greedy_answer(mooncake_pods)
        if text_until_near_tie(want, got["logprobs"]["content"]) == len(want):  # else parted at a near-tie
            assert got["message"]["content"] == want
