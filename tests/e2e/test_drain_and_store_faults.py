"""Two more faults on a real local cluster, with the kvstore on:

- SIGTERM to the decode that runs a stream: the stream finishes (tokens equal an uninterrupted greedy
  run), the decode exits 0 within its grace, and new requests go to the other decode;
- the kvstore killed: requests are still served (without reuse, counted), and once it is back on its
  address reuse resumes: a prompt prefilled on one prefill is loaded from the store by the other.

2 prefills (round-robin) x 2 decodes, fp32, bounded time.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import load, metric_sum, post_json, stream_tokens, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KV = ["--kv-cache-bytes", str(96 << 20)]
SHORT = "The history of the city begins with"
# About 160 tokens: ten full 16-token pages the kvstore can hold and hand to the other prefill.
SHARED = " ".join(f"Fact {i}: the river number {i} flows to the sea." for i in range(14))


@pytest.fixture(scope="module")
def cluster():
    extra = {"prefill": KV, "decode": [*KV, "--drain-timeout-s", "60"],
             "router": ["--policy", "round_robin", "--health-interval-s", "0.5"]}
    with LocalCluster(prefill=2, decode=2, kvstore="embedded", dtype="float32", extra=extra, quiet=True) as c:
        yield c


def _names(c: LocalCluster, role: str) -> list[str]:
    return [p.name for p in c.procs if p.name.startswith(f"{role}-")]


def _healthy(c: LocalCluster, n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while metric_sum(c.router["metrics"], "pdserve_router_instance_healthy") != n:
        assert time.monotonic() < deadline, f"the router did not see {n} healthy workers"
        time.sleep(0.2)


def test_sigterm_to_a_busy_decode_lets_its_stream_finish_and_exits_0(cluster: LocalCluster):
    c = cluster
    _healthy(c, 4)
    router = c.router["grpc"]
    reference = asyncio.run(stream_tokens(router, SHORT, 40))
    victim: list[str] = []

    async def terminate_busy_decode() -> None:
        for name in _names(c, "decode"):
            rep = await load(c.get(name).ready["grpc"])
            if rep.running or rep.waiting:
                victim.append(name)
                c.kill(name, signal.SIGTERM)
                return
        raise AssertionError("no decode reported the running request")

    got = asyncio.run(stream_tokens(router, SHORT, 40, after=4, action=terminate_busy_decode))
    assert victim, "the stream ended before a decode could be told to stop"
    assert got == reference  # finished where it ran: no migration needed, no gap, no duplicate
    proc = c.get(victim[0]).popen
    assert proc is not None
    assert proc.wait(60) == 0, "a drained decode exits 0"
    # New work goes to the decode that is left.
    status, body = post_json(c.router["http"], "/v1/completions", {
        "model": served_model(c.router["http"]), "prompt": SHORT, "max_tokens": 6, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 6, body
    c.restart(victim[0], timeout=180)
    _healthy(c, 4)


def _complete(c: LocalCluster, prompt: str) -> dict:
    status, body = post_json(c.router["http"], "/v1/completions", {
        "model": served_model(c.router["http"]), "prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return body


def _from_store(c: LocalCluster) -> float:
    return sum(metric_sum(c.get(n).ready["metrics"], "pdserve_prefill_cached_prefix_tokens_total", source="kvstore")
               for n in _names(c, "prefill"))


def test_kvstore_down_serves_without_reuse_and_reuse_resumes(cluster: LocalCluster):
    c = cluster
    _healthy(c, 4)
    c.kill("kvstore", signal.SIGKILL)
    errors0 = sum(metric_sum(c.get(n).ready["metrics"], "pdserve_prefill_kvstore_errors_total")
                  for n in _names(c, "prefill"))
    for i in range(2):  # round-robin: each prefill meets the dead store at least once
        assert _complete(c, f"Outage {i}. {SHARED}")["usage"]["completion_tokens"] == 4
    errors1 = sum(metric_sum(c.get(n).ready["metrics"], "pdserve_prefill_kvstore_errors_total")
                  for n in _names(c, "prefill"))
    assert errors1 > errors0, "serving without the store is counted"

    c.restart("kvstore", timeout=120)
    before = _from_store(c)
    deadline = time.monotonic() + 60
    turn = 0
    # The same new prompt twice in a row: round-robin sends the second to the other prefill, which loads
    # the pages the first wrote back. The prefills' store clients reconnect on their own (backoff).
    while _from_store(c) <= before:
        assert time.monotonic() < deadline, "reuse through the kvstore did not resume"
        prompt = f"Recovery {turn}. {SHARED}"
        _complete(c, prompt)
        time.sleep(0.5)  # write-back is asynchronous
        _complete(c, prompt)
        turn += 1
    for n in _names(c, "decode") + _names(c, "prefill"):
        rep = wait_idle(c.get(n).ready["grpc"], timeout=20)
        assert rep.free_blocks == rep.total_blocks, (n, rep)
