"""The operator surface on a real 1P1D cluster (kvstore on) configured by a YAML file: the first request
after start shows in increase() of a real Prometheus, top_logprobs cross the P/D path (the first token's
alternatives come from prefill), usage arithmetic holds against the services' own counters on a run
with prefix hits, and the router serves Admin, /metrics on its HTTP port, /v1/models/{id} under the
served name, and one access-log line per request."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from services.common import metrics as m
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc
from services.launcher import LocalCluster
from tests.e2e.cluster_util import metric_sum, metrics_text
from tests.prom_harness import PrometheusHarness, require_prometheus

SERVED = "smol"
ACCESS_LOG_WAIT_S = 30.0
"""Longest wait for a request's access-log line to reach the captured router output (seconds)."""
LONG = ("The observatory on the hill kept careful records of every storm that crossed the valley, noting the "
        "hour, the wind, the colour of the sky and the height of the river. ") * 3
CONFIG = f"""\
max_model_len: 1536
router:
  served_model_name: {SERVED}
  policy: round_robin
  access_log: true
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cfg = tmp_path_factory.mktemp("cfg") / "pdserve.yaml"
    cfg.write_text(CONFIG)
    extra = {mod: ["--config", str(cfg)] for mod in ("router", "prefill", "decode", "kvstore")}
    with LocalCluster(prefill=1, decode=1, kvstore="embedded", kv_transport="grpc", quiet=True, extra=extra,
                      env={"PDSERVE_KV_CACHE_BYTES": str(192 << 20)}) as c:
        yield c


def _client(c: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{c.router['http']}/v1", api_key="x", max_retries=0, timeout=300)


def _sum(c: LocalCluster, name: str, **labels: str) -> float:
    return sum(metric_sum(c.get(s).ready["metrics"], name, **labels) for s in ("prefill-0",))


def test_first_request_after_start_shows_in_increase(cluster: LocalCluster) -> None:
    """Runs first: no generation has happened yet. Every series the request moves existed (at 0) before
    it, so increase() over a window holding the request is > 0 rather than the 0 of a series born at 1."""
    require_prometheus()
    targets = [cluster.get(n).ready["metrics"] for n in ("router", "prefill-0", "decode-0", "kvstore")]
    with PrometheusHarness(targets) as prom:
        prom.wait_for_scrapes(2)
        assert metric_sum(cluster.router["metrics"], m.ROUTER_REQUESTS_TOTAL) == 0  # really the first
        r = _client(cluster).chat.completions.create(model=SERVED, max_tokens=4, temperature=0,
                                                     messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].finish_reason in ("stop", "length")
        done = prom.query('min(sum_over_time(up{job="pdserve"}[5m]))')
        prom.wait_for_scrapes(int(float(done[0]["value"][1])) + 3)  # three more scrapes of every target
        for expr in (f'sum(increase({m.ROUTER_REQUESTS_TOTAL}{{status="ok"}}[2m]))',
                     f"sum(increase({m.ROUTER_E2E_SECONDS}_count[2m]))",
                     f"sum(increase({m.ROUTER_TTFT_SECONDS}_count[2m]))",
                     f"sum(increase({m.PREFILL_COMPUTE_SECONDS}_count[2m]))",
                     f"sum(increase({m.DECODE_KV_WAIT_SECONDS}_count[2m]))"):
            got = prom.query(expr)
            value = float(got[0]["value"][1]) if got else 0.0
            assert value >= 0.5, f"{expr} = {value}: the first request is invisible to increase()"
        # Counters that have not fired are series at 0 from the start, not absent.
        zero = prom.query(f'sum({m.ROUTER_ERRORS_TOTAL}{{code="unavailable"}})')
        assert zero and float(zero[0]["value"][1]) == 0.0


def test_top_logprobs_cross_prefill_and_decode(cluster: LocalCluster) -> None:
    r = _client(cluster).chat.completions.create(
        model=SERVED, max_tokens=6, temperature=0, logprobs=True, top_logprobs=5,
        messages=[{"role": "user", "content": "Name a colour."}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens >= 2
    for pos in content:  # position 0 was sampled by prefill, the rest by decode
        values = [a.logprob for a in pos.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert pos.top_logprobs[0].token == pos.token and math.isclose(values[0], pos.logprob, abs_tol=1e-4)

    async def stream() -> list:
        client = openai.AsyncOpenAI(base_url=f"http://{cluster.router['http']}/v1", api_key="x", max_retries=0)
        try:
            out = []
            async for chunk in await client.completions.create(model=SERVED, prompt="Colours:", max_tokens=4,
                                                               temperature=0, logprobs=3, stream=True):
                out += chunk.choices[0].logprobs.top_logprobs if chunk.choices and chunk.choices[0].logprobs else []
            return out
        finally:
            await client.close()

    tops = asyncio.run(stream())
    assert len(tops) == 4 and all(3 <= len(t) <= 4 for t in tops)


def test_usage_matches_the_services_counters_with_prefix_hits(cluster: LocalCluster) -> None:
    client = _client(cluster)
    before = {"computed": _sum(cluster, m.PREFILL_COMPUTED_TOKENS_TOTAL),
              "cached": _sum(cluster, m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL),
              "prompt": metric_sum(cluster.router["metrics"], m.ROUTER_PROMPT_TOKENS_TOTAL)}
    usages = [client.completions.create(model=SERVED, prompt=LONG + f" Question {k}: what was noted?",
                                        max_tokens=3, temperature=0).usage for k in range(3)]
    time.sleep(0.5)  # the services count just after the last byte
    after = {"computed": _sum(cluster, m.PREFILL_COMPUTED_TOKENS_TOTAL),
             "cached": _sum(cluster, m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL),
             "prompt": metric_sum(cluster.router["metrics"], m.ROUTER_PROMPT_TOKENS_TOTAL)}
    d = {k: after[k] - before[k] for k in before}
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    print(f"\nusage prompt={prompt} cached={cached}; counters {d}")
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)
    assert all(u.prompt_tokens_details.cached_tokens < u.prompt_tokens for u in usages)
    assert usages[1].prompt_tokens_details.cached_tokens > 0  # the shared prefix was reused
    assert d["prompt"] == prompt == d["computed"] + d["cached"]  # prompt = computed + cached, each once
    assert cached == d["cached"]


def test_router_admin_metrics_on_http_models_and_access_log(cluster: LocalCluster) -> None:
    http = cluster.router["http"]
    assert m.ROUTER_REQUESTS_TOTAL in metrics_text(http)  # /metrics on the API port too
    card = _client(cluster).models.retrieve(SERVED)
    assert card.id == SERVED and card.max_model_len == 1536  # from the config file's top level

    async def admin(address: str) -> tuple[common_pb2.LoadReport, common_pb2.CaptureTraceResponse]:
        async with create_channel(address) as ch:
            stub = common_pb2_grpc.AdminStub(ch)
            load = await stub.GetLoad(common_pb2.GetLoadRequest(), timeout=10)
            trace = await stub.CaptureTrace(common_pb2.CaptureTraceRequest(duration_s=0.3, out_dir="e2e"),
                                            timeout=30)
            return load, trace

    for name, service in (("router", "router"), ("kvstore", "kvstore")):
        load, trace = asyncio.run(admin(cluster.get(name).ready["grpc"]))
        assert load.published_unix > 0 and trace.service == service
        assert Path(trace.path).is_file() and '"traceEvents"' in Path(trace.path).read_text()[:200]
    done = _client(cluster).completions.create(model=SERVED, prompt="Hello", max_tokens=2, temperature=0)
    # The router writes its access line after the last byte, and its output reaches us through a pipe
    # and a reader thread: wait for the line (bounded) instead of reading once.
    deadline = time.monotonic() + ACCESS_LOG_WAIT_S
    while True:
        lines = [ln for ln in cluster.get("router").lines
                 if "pdserve.access" in ln and " request " in ln and f"id={done.id}" in ln]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lines, cluster.get("router").tail(40)
    last = lines[-1]
    for key in ("id=cmpl", "api=http", "wire=200", "status=ok", "prompt_tokens=", "completion_tokens=",
                "ttft_s=", "e2e_s=", "finish_reason="):
        assert key in last, last
