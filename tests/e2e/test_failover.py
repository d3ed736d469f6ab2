"""A prefill dies: requests retry on another prefill; the router marks it unhealthy and takes it
back once a new process serves on its address."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from services.common.grpc_util import wait_for_serving
from services.launcher import LocalCluster
from tests.e2e.cluster_util import metric_sum, post_json

pytestmark = pytest.mark.e2e

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(http: str) -> None:
    status, body = post_json(http, "/v1/completions", {"model": MODEL, "prompt": "One, two, three,",
                                                       "max_tokens": 4, "temperature": 0})
    assert status == 200, body


def test_prefill_failover_and_recovery():
    port = _free_port()
    kv = ["--kv-cache-bytes", str(96 << 20)]
    extra = {"prefill": kv, "decode": kv, "prefill-1": ["--port", str(port)],
             "router": ["--policy", "round_robin", "--health-interval-s", "1.5"]}
    with LocalCluster(prefill=2, decode=1, kvstore=None, extra=extra, quiet=True) as c:
        http, rmetrics = c.router["http"], c.router["metrics"]
        dead = f"127.0.0.1:{port}"
        _ask(http)
        c.get("prefill-1").popen.send_signal(signal.SIGKILL)
        c.get("prefill-1").popen.wait()
        for _ in range(4):  # round-robin sends one of these to the dead prefill first
            _ask(http)
        assert metric_sum(rmetrics, "pdserve_router_dispatch_retries_total", role="prefill") >= 1
        assert metric_sum(rmetrics, "pdserve_router_instance_healthy", role="prefill", endpoint=dead) == 0

        # A new prefill on the same address is taken back by the health checks.
        proc = subprocess.Popen([sys.executable, "-m", "services.prefill", "--host", "127.0.0.1", "--port", str(port),
                                 "--metrics-port", "0", *kv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            asyncio.run(wait_for_serving(dead, 120))
            deadline = time.monotonic() + 15
            while metric_sum(rmetrics, "pdserve_router_instance_healthy", role="prefill", endpoint=dead) != 1:
                assert time.monotonic() < deadline, "router did not take the prefill back"
                time.sleep(0.3)
            before = metric_sum(c.get("prefill-0").ready["metrics"], "pdserve_prefill_compute_seconds_count")
            for _ in range(4):
                _ask(http)
            after = metric_sum(c.get("prefill-0").ready["metrics"], "pdserve_prefill_compute_seconds_count")
            assert after - before == 2  # round-robin again splits the four between both prefills
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
