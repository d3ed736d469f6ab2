"""Supervised services with their step loop in an engine-core process (``--engine-core process``). A colocated worker:
the core killed with SIGKILL mid-stream takes the worker down (exit 3), the supervisor restarts it on its
ports, the stream in flight either completes through the router's migration or ends with an error event
(never a silent short answer), and the next request is served."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time

import pytest

from benchmarks.served_cost import engine_core_pid
from services.launcher import LocalCluster, RestartPolicy, served_model
from tests.e2e.cluster_util import metric_sum, post_json
from tests.process_util import alive

KV = ["--kv-cache-bytes", str(96 << 20)]


def _wait_for(what: str, cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stream(http_addr: str, body: dict, events: list[str], started: threading.Event) -> None:
    host, port = http_addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        events.append(f"status {resp.status}")
        for line in resp:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
    except OSError as e:
        events.append(f"broken {e!r}")
    finally:
        started.set()
        conn.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_engine_core_ends_its_stream_clearly_and_the_worker_comes_back() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=300, backoff_s=0.5, max_backoff_s=1.0)
    extra = {"decode": [*KV, "--engine-core", "process"], "router": ["--health-interval-s", "0.5"]}
    with LocalCluster(prefill=0, decode=1, colocated=True, kvstore=None, extra=extra, quiet=True, supervise=True,
                      restart_policy=policy) as c:
        http_addr, rmetrics = c.router["http"], c.router["metrics"]
        model = served_model(http_addr)
        worker = c.get("worker-0")
        before = dict(worker.ready)
        old_pid = int(before["pid"])
        core = engine_core_pid(old_pid)
        assert core is not None and alive(core)
        events: list[str] = []
        started = threading.Event()
        t = threading.Thread(target=_stream, args=(http_addr, {
            "model": model, "prompt": "Count: one, two,", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}, events, started))
        t.start()
        assert started.wait(60)
        os.kill(core, signal.SIGKILL)
        t.join(300)
        assert not t.is_alive()
        assert events[0] == "status 200"
        if "[DONE]" in events:  # migrated to the restarted worker: the whole answer, finished by length
            chunks = [json.loads(e) for e in events[1:] if e.startswith("{")]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length", events[-3:]
        else:  # or a clear error event, never a short answer that looks complete
            assert "error" in json.loads(events[-1]), events[-3:]
        _wait_for("worker-0 to come back", lambda: c.get("worker-0").ready.get("pid", str(old_pid)) != str(old_pid),
                  90)
        after = c.get("worker-0").ready
        assert (after["grpc"], after["metrics"]) == (before["grpc"], before["metrics"])
        assert not alive(old_pid) and not alive(core)
        new_core = engine_core_pid(int(after["pid"]))
        assert new_core is not None and new_core != core
        _wait_for("the router to see worker-0 healthy again", lambda: metric_sum(
            rmetrics, "pdserve_router_instance_healthy", role="worker", endpoint=after["grpc"]) == 1, 30)
        status, body = post_json(http_addr, "/v1/completions", {"model": model, "prompt": "One, two, three,",
                                                                "max_tokens": 4, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 4


@pytest.mark.e2e
@pytest.mark.slow
def test_a_killed_prefill_engine_core_restarts_the_prefill_and_requests_are_served_again() -> None:
    """P/D: the prefill's engine core (the CPU default) killed with SIGKILL takes the prefill down (exit 3); a request
    sent meanwhile gets the answer or a designed refusal, never a hang or a short answer; the supervisor brings the
    prefill back on its ports with a new core, and the same prompt then gets the same tokens as before the kill."""
    policy = RestartPolicy(max_restarts=2, window_s=300, backoff_s=0.5, max_backoff_s=1.0)
    extra = {"prefill": [*KV, "--engine-core", "process"], "decode": KV, "router": ["--health-interval-s", "0.5"]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, extra=extra, quiet=True, supervise=True,
                      restart_policy=policy) as c:
        http_addr, rmetrics = c.router["http"], c.router["metrics"]
        model = served_model(http_addr)
        body = {"model": model, "prompt": "One, two, three,", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "logprobs": 0}
        status, first = post_json(http_addr, "/v1/completions", body)
        assert status == 200, first
        want = first["choices"][0]["logprobs"]["tokens"]
        before = dict(c.get("prefill-0").ready)
        old_pid = int(before["pid"])
        core = engine_core_pid(old_pid)
        assert core is not None and alive(core)
        os.kill(core, signal.SIGKILL)
        _wait_for("the prefill to exit", lambda: not alive(old_pid), 30)
        status, during = post_json(http_addr, "/v1/completions", body)
        if status == 200:  # served all the same (the router retries within its deadline): the same tokens
            assert during["choices"][0]["logprobs"]["tokens"] == want, during
        else:  # or refused as designed: no prefill serving right now
            assert status in (429, 503, 504), (status, during)
            assert "error" in during, during
        _wait_for("prefill-0 to come back", lambda: c.get("prefill-0").ready.get("pid", str(old_pid)) != str(old_pid),
                  90)
        after = c.get("prefill-0").ready
        assert after["grpc"] == before["grpc"]
        assert not alive(core)
        new_core = engine_core_pid(int(after["pid"]))
        assert new_core is not None and new_core != core
        _wait_for("the router to see prefill-0 healthy again", lambda: metric_sum(
            rmetrics, "pdserve_router_instance_healthy", role="prefill", endpoint=after["grpc"]) == 1, 30)
        status, again = post_json(http_addr, "/v1/completions", body)
        assert status == 200, again
        assert again["choices"][0]["logprobs"]["tokens"] == want
