"""The only prefill of a supervised cluster (what `pdserve up` runs) is killed -9 while it computes a
request: the router waits for the supervisor's restart instead of failing at once, the request
completes within its deadline, and pdserve_router_instance_waits_total says it waited."""

from __future__ import annotations

import threading
import time

import pytest

from services.launcher import LocalCluster, RestartPolicy, served_model
from tests.e2e.cluster_util import load_sync, metric_sum, post_json

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KV = ["--kv-cache-bytes", str(96 << 20)]
DEADLINE_S = 240  # the request's own deadline: a restarted prefill loads its model well within it
PROMPT = " ".join(f"Item {i} of the list is the word number {i}." for i in range(18))


def test_request_waits_for_the_only_prefill_to_restart() -> None:
    policy = RestartPolicy(max_restarts=2, window_s=300, backoff_s=0.5, max_backoff_s=1.0)
    extra = {"prefill": ["--max-prefill-chunk", "32", "--slowdown-ms-per-chunk", "400", *KV], "decode": KV,
             "router": ["--health-interval-s", "0.5", "--restart-wait-s", str(DEADLINE_S)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, dtype="float32", kv_transport="grpc", extra=extra,
                      quiet=True, supervise=True, restart_policy=policy) as c:
        http, rmetrics = c.router["http"], c.router["metrics"]
        out: dict = {}

        def run() -> None:
            out["status"], out["body"] = post_json(http, "/v1/completions", {
                "model": served_model(http), "prompt": f"Restart. {PROMPT}", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}, timeout=DEADLINE_S + 30)

        t0 = time.monotonic()
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        prefill = c.get("prefill-0").ready["grpc"]
        deadline = time.monotonic() + 60
        while not load_sync(prefill).running:
            assert time.monotonic() < deadline and thread.is_alive(), f"the prefill never ran the request: {out}"
            time.sleep(0.05)
        time.sleep(1.0)  # mid-compute (400 ms per 32-token chunk)
        old_pid = c.kill("prefill-0")
        thread.join(DEADLINE_S + 30)
        assert out.get("status") == 200, out
        assert out["body"]["usage"]["completion_tokens"] == 8
        assert time.monotonic() - t0 < DEADLINE_S
        assert c.get("prefill-0").ready.get("pid") != str(old_pid)  # served by the restarted process
        assert metric_sum(rmetrics, "pdserve_router_instance_waits_total", role="prefill", outcome="back") == 1
