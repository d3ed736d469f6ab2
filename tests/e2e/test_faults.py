"""Faults on a real local cluster (processes on loopback, fp32, bounded time):

- kill -9 of a decode mid-generation with 2 decodes: the stream migrates and its tokens equal an
  uninterrupted greedy run's;
- kill -9 of a prefill mid-transfer with 2 prefills: the request completes on the other one;
- kill -9 of the only prefill left mid-transfer: a clean error, and decode's blocks back to baseline.

One 2P2D cluster serves the module; each scenario restarts what the previous one killed (same ports).
Prefills sleep after each 32-token chunk (--slowdown-ms-per-chunk) to widen the mid-transfer window.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import load, metric_sum, post_json, stream_tokens, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KV = ["--kv-cache-bytes", str(96 << 20)]
CHUNK, SLOWDOWN_MS = 32, 400
# ~190 tokens: 6 prefill chunks, ~2.4 s of slowdown: the window a prefill is killed in.
LONG = " ".join(f"Item {i} of the list is the word number {i}." for i in range(18))
SHORT = "The history of the city begins with"


@pytest.fixture(scope="module")
def cluster():
    extra = {"prefill": ["--max-prefill-chunk", str(CHUNK), "--slowdown-ms-per-chunk", str(SLOWDOWN_MS), *KV],
             "decode": KV,
             # Nothing restarts what a scenario kills here: a request waits for a restart only briefly.
             "router": ["--policy", "least_loaded", "--health-interval-s", "0.5", "--dead-after-s", "10",
                        "--restart-wait-s", "3"]}
    with LocalCluster(prefill=2, decode=2, kvstore=None, dtype="float32", extra=extra, quiet=True) as c:
        yield c


def _workers(c: LocalCluster, role: str) -> list[str]:
    return [p.name for p in c.procs if p.name.startswith(f"{role}-")]


def _grpc(c: LocalCluster, name: str) -> str:
    return c.get(name).ready["grpc"]


def _kill(c: LocalCluster, name: str) -> None:
    p = c.get(name)
    assert p.popen is not None
    p.popen.send_signal(signal.SIGKILL)
    p.popen.wait(10)


@pytest.fixture
def whole(cluster: LocalCluster) -> LocalCluster:
    """The cluster with every service up and seen healthy by the router (restarting what a previous
    scenario killed)."""
    for p in list(cluster.procs):
        if p.popen is None or p.popen.poll() is not None:
            cluster.restart(p.name, timeout=120)
    deadline = time.monotonic() + 30
    while metric_sum(cluster.router["metrics"], "pdserve_router_instance_healthy") != 4:
        assert time.monotonic() < deadline, "the router did not see all four workers healthy"
        time.sleep(0.2)
    return cluster


def _blocks_back(c: LocalCluster, name: str) -> None:
    """Nothing left running or queued on ``name`` and every block free within 10 s: sooner than any
    lease (30 s) would free a decode's."""
    rep = wait_idle(_grpc(c, name), timeout=10)
    assert rep.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0 and rep.running == 0, (name, rep)


def _survivors_idle(c: LocalCluster) -> None:
    for name in _workers(c, "prefill") + _workers(c, "decode"):
        p = c.get(name)
        if p.popen is not None and p.popen.poll() is None:
            _blocks_back(c, name)


def test_decode_killed_mid_generation_migrates_with_equal_tokens(whole: LocalCluster):
    c = whole
    router = c.router["grpc"]
    reference = asyncio.run(stream_tokens(router, SHORT, 48))
    assert len(reference) == 48
    victim: list[str] = []

    async def kill_busy_decode() -> None:
        for name in _workers(c, "decode"):
            rep = await load(_grpc(c, name))
            if rep.running or rep.waiting:
                victim.append(name)
                _kill(c, name)
                return
        raise AssertionError("no decode reported the running request")

    t0 = time.monotonic()
    migrated = asyncio.run(stream_tokens(router, SHORT, 48, after=6, action=kill_busy_decode))
    assert victim, "the stream ended before a decode could be killed"
    assert migrated == reference  # no duplicate, no gap, same greedy tokens
    assert time.monotonic() - t0 < 60
    assert metric_sum(c.router["metrics"], "pdserve_router_migrations_total", outcome="ok") >= 1
    _survivors_idle(c)


def _kill_prefill_mid_transfer(c: LocalCluster, candidates: list[str]) -> str:
    """Wait until one of ``candidates`` runs the request, let it compute and send ~2 chunks, kill -9 it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for name in candidates:
            if asyncio.run(load(_grpc(c, name))).running:
                time.sleep(2.5 * SLOWDOWN_MS / 1000)
                _kill(c, name)
                return name
        time.sleep(0.05)
    raise AssertionError("no prefill started the request")


def _post_async(http: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["status"], out["body"] = post_json(http, "/v1/completions", body, timeout=90)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _completion(c: LocalCluster, max_tokens: int, topic: str) -> dict:
    """A long prompt no prefill has cached (``topic`` leads it)."""
    return {"model": served_model(c.router["http"]), "prompt": f"{topic}. {LONG}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}


def test_prefill_killed_mid_transfer_retries_on_the_other(whole: LocalCluster):
    c = whole
    http = c.router["http"]
    retries = metric_sum(c.router["metrics"], "pdserve_router_dispatch_retries_total", role="prefill")
    t0 = time.monotonic()
    thread, out = _post_async(http, _completion(c, 8, "Colours"))
    victim = _kill_prefill_mid_transfer(c, _workers(c, "prefill"))
    thread.join(90)
    assert out.get("status") == 200, out
    assert out["body"]["usage"]["completion_tokens"] == 8
    assert out["body"]["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - t0 < 60
    assert metric_sum(c.router["metrics"], "pdserve_router_dispatch_retries_total", role="prefill") > retries
    assert victim in _workers(c, "prefill")
    _survivors_idle(c)


def test_only_prefill_killed_mid_transfer_fails_cleanly_and_frees_decode_blocks(whole: LocalCluster):
    c = whole
    http = c.router["http"]
    first, last = _workers(c, "prefill")
    _kill(c, first)  # one prefill left
    deadline = time.monotonic() + 15
    while metric_sum(c.router["metrics"], "pdserve_router_instance_healthy", role="prefill") != 1:
        assert time.monotonic() < deadline, "the router did not see the first prefill die"
        time.sleep(0.2)
    t0 = time.monotonic()
    thread, out = _post_async(http, _completion(c, 8, "Animals"))
    _kill_prefill_mid_transfer(c, [last])
    thread.join(90)
    assert out.get("status") == 503, out  # before the first byte: a status and a JSON error
    assert out["body"].get("error", {}).get("message"), out
    assert time.monotonic() - t0 < 60
    _survivors_idle(c)  # the reservation was aborted: every decode block is free again
