"""A prefill dies: requests retry on another prefill; the router marks it dead (connection refused, long
before its dead-after window) and takes it back once a new process serves on its address."""

from __future__ import annotations

import signal
import time

import pytest

from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import metric_sum, post_json

pytestmark = pytest.mark.e2e


def _ask(http: str, model: str) -> None:
    status, body = post_json(http, "/v1/completions", {"model": model, "prompt": "One, two, three,",
                                                       "max_tokens": 4, "temperature": 0})
    assert status == 200, body


def _healthy(rmetrics: str, endpoint: str) -> float:
    return metric_sum(rmetrics, "pdserve_router_instance_healthy", role="prefill", endpoint=endpoint)


def test_prefill_failover_and_recovery():
    kv = ["--kv-cache-bytes", str(96 << 20)]
    extra = {"prefill": kv, "decode": kv,
             "router": ["--policy", "round_robin", "--health-interval-s", "1.5", "--dead-after-s", "60"]}
    with LocalCluster(prefill=2, decode=1, kvstore=None, extra=extra, quiet=True) as c:
        http, rmetrics = c.router["http"], c.router["metrics"]
        model = served_model(http)
        dead = c.get("prefill-1").ready["grpc"]
        _ask(http, model)
        proc = c.get("prefill-1").popen
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        for _ in range(4):  # round-robin sends one of these to the dead prefill first
            _ask(http, model)
        assert metric_sum(rmetrics, "pdserve_router_dispatch_retries_total", role="prefill") >= 1
        while _healthy(rmetrics, dead) != 0:  # refused: dead at once, not after --dead-after-s 60
            assert time.monotonic() - t0 < 10, "the router did not see the refused prefill as dead"
            time.sleep(0.2)

        # A new prefill on the same address is taken back by the health checks.
        c.restart("prefill-1", timeout=120)
        assert c.get("prefill-1").ready["grpc"] == dead
        deadline = time.monotonic() + 15
        while _healthy(rmetrics, dead) != 1:
            assert time.monotonic() < deadline, "router did not take the prefill back"
            time.sleep(0.3)
        before = metric_sum(c.get("prefill-0").ready["metrics"], "pdserve_prefill_compute_seconds_count")
        for _ in range(4):
            _ask(http, model)
        after = metric_sum(c.get("prefill-0").ready["metrics"], "pdserve_prefill_compute_seconds_count")
        assert after - before == 2  # round-robin again splits the four between both prefills
