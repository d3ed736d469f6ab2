"""Observability on a real local cluster (docs/METRICS.md).

One module-scoped cluster: kvstore (embedded), prefill-0 (normal), prefill-1 (slowed: sleeps after every
computed chunk), one decode, the launcher's router (round-robin over both prefills) and a second router
("router-2") that forces chunked transfer off and reaches prefill-0 both directly and through a loopback
TCP forwarder the test can cut (a backend that becomes unreachable: real dispatch retries).

* test_timers_tell_slow_prefill_from_exposed_transfer: decode KV-wait follows prefill time, exposed KV
  transfer follows what overlap could not hide (chunked transfer off: grows with prompt length).
* test_every_dashboard_panel_has_data_from_a_live_cluster: a real Prometheus scrapes every service; every
  query of every Grafana panel returns data. Conditions a healthy run never produces (KV transfer failures,
  rejected chunks, expired reservations, dispatch retries, client errors) are produced for real first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common import metrics as m
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.launcher import LocalCluster, served_model
from tests.common.test_dashboards import SPEC_PANEL, _exprs, panel_failures
from tests.e2e.cluster_util import generate_ids, metric_sum, metrics_text, post_json
from tests.prom_harness import PrometheusHarness, require_prometheus

pytestmark = pytest.mark.e2e

CHUNK = 32            # --max-prefill-chunk: a long prompt is computed in several chunks
SLOWDOWN_MS = 400     # prefill-1 sleeps this long after each computed chunk
LONG = 8 * CHUNK      # tokens of a "long" prompt: 8 chunks (~1-2 s of compute on a busy 2-core box)
SHORT = CHUNK         # tokens of a "short" prompt: one chunk
KV = ["--kv-cache-bytes", str(96 << 20)]  # float32 SmolLM2: ~2100 tokens per instance
TOO_LONG = 4000       # prompt tokens no decode here can hold (fits the model's 8192 context)


class TcpForwarder:
    """Loopback TCP forwarder to one backend; cut() closes the listener and every open connection, so
    clients that had a working channel to `address` now get connection refused (UNAVAILABLE)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        self._cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._cut.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target, timeout=5)
                upstream.settimeout(None)
                client.settimeout(None)
            except OSError:
                client.close()
                continue
            self._socks += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self._cut.set()
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@dataclass
class Obs:
    cluster: LocalCluster
    router2: dict[str, str]
    forwarder: TcpForwarder
    model: str

    def metrics(self, name: str) -> str:
        return self.cluster.get(name).ready["metrics"]

    def grpc(self, name: str) -> str:
        return self.cluster.get(name).ready["grpc"]


@pytest.fixture(scope="module")
def obs() -> Iterator[Obs]:
    extra = {
        "prefill": ["--max-prefill-chunk", str(CHUNK), *KV],
        "prefill-1": ["--slowdown-ms-per-chunk", str(SLOWDOWN_MS)],
        "decode": KV,
        "router": ["--policy", "round_robin"],
    }
    with LocalCluster(prefill=2, decode=1, kvstore="embedded", dtype="float32", extra=extra, quiet=True) as c:
        forwarder = TcpForwarder(c.get("prefill-0").ready["grpc"])
        # A second router: chunked transfer forced off; prefill-0 reachable directly and through the
        # forwarder. Health checks are rare, so a cut forwarder is found by a request (-> retry).
        c.extra["router-2"] = ["--prefill", f"{forwarder.address},{c.get('prefill-0').ready['grpc']}",
                               "--no-chunked-transfer", "--health-interval-s", "120"]
        router2 = c._spawn("router-2", "router", ["--port", "0", "--http-port", "0", "--metrics-port", "0",
                                                  "--decode", c.get("decode-0").ready["grpc"]])
        c._wait([router2], 60)
        try:
            yield Obs(c, router2.ready, forwarder, served_model(c.router["http"]))
        finally:
            forwarder.cut()


# --- helpers --------------------------------------------------------------------------------------

def _scrape(address: str) -> dict[str, float]:
    """Sample name -> value summed over labels (histograms: _sum and _count)."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text(address)):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _generate(router_grpc: str, ids: list[int], max_tokens: int = 4) -> common_pb2.GenerateResponse:
    return asyncio.run(generate_ids(router_grpc, ids, max_tokens, deadline_s=120))[-1]


_rng = random.Random(1234)


def _prompt(n: int) -> list[int]:
    """A fresh prompt of n tokens: no prefix shared with any other (no cache on either side helps)."""
    return [_rng.randrange(1000, 40000) for _ in range(n)]


@dataclass
class Sample:
    prefill: str
    kv_wait: float
    exposed: float
    compute: float


def _one(o: Obs, router_grpc: str, n: int) -> Sample:
    """Send one request alone; read what it added to decode's timers and which prefill computed it."""
    names = ("prefill-0", "prefill-1")
    before = {k: _scrape(o.metrics(k)) for k in ("decode-0", *names)}
    resp = _generate(router_grpc, _prompt(n))
    assert resp.usage.completion_tokens == 4, resp
    after = {k: _scrape(o.metrics(k)) for k in ("decode-0", *names)}

    def delta(svc: str, sample: str) -> float:
        return after[svc].get(sample, 0.0) - before[svc].get(sample, 0.0)

    wait, exposed, compute = (m.DECODE_KV_WAIT_SECONDS, m.DECODE_KV_TRANSFER_EXPOSED_SECONDS,
                              m.PREFILL_COMPUTE_SECONDS)
    assert delta("decode-0", wait + "_count") == 1 and delta("decode-0", exposed + "_count") == 1
    (prefill,) = [p for p in names if delta(p, compute + "_count") == 1]
    return Sample(prefill, delta("decode-0", wait + "_sum"), delta("decode-0", exposed + "_sum"),
                  delta(prefill, compute + "_sum"))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# --- Must show 2 ----------------------------------------------------------------------------------

def test_timers_tell_slow_prefill_from_exposed_transfer(obs: Obs) -> None:
    """What each timer measures (services/decode/servicer.py `_landed`, services/prefill/kv_stream.py):
    KV-wait = decode's reservation -> last KV chunk landed, so under parallel dispatch it contains the
    prefill's queue and compute; exposed transfer = prefill's last chunk computed (wall clock, stamped
    before its pages are read) -> last chunk landed, i.e. only the transfer that did not overlap compute.
    """
    router1, router2 = obs.cluster.router["grpc"], obs.router2["grpc"]
    _generate(router1, _prompt(SHORT))  # first-call costs (channels, allocator) out of the samples
    _generate(router1, _prompt(SHORT))

    # Chunked transfer on (each prefill's default), long prompt: round-robin alternates the normal and
    # the slowed prefill; keep going until both have served two.
    on: dict[str, list[Sample]] = {"prefill-0": [], "prefill-1": []}
    for _ in range(8):
        s = _one(obs, router1, LONG)
        on[s.prefill].append(s)
        if all(len(v) >= 2 for v in on.values()):
            break
    fast, slow = on["prefill-0"], on["prefill-1"]
    assert len(fast) >= 2 and len(slow) >= 2, on
    # Chunked transfer off (router-2 forces it; prefill-0 only): a long and a short prompt.
    off_long = [_one(obs, router2, LONG) for _ in range(2)]
    off_short = [_one(obs, router2, SHORT) for _ in range(2)]
    assert {s.prefill for s in off_long + off_short} == {"prefill-0"}

    def means(xs: list[Sample]) -> dict[str, float]:
        return {k: round(_mean([getattr(s, k) for s in xs]), 4) for k in ("kv_wait", "exposed", "compute")}

    fast_m, slow_m, long_m, short_m = means(fast), means(slow), means(off_long), means(off_short)
    print(f"\nmean seconds: chunked on, normal prefill {fast_m}\n"
          f"              chunked on, slowed prefill {slow_m}\n"
          f"              chunked off, {LONG}-token prompt {long_m}\n"
          f"              chunked off, {SHORT}-token prompt {short_m}")

    # Slowed prefill: decode's KV-wait grows with prefill time (it contains it) ... The sleep after the
    # last chunk comes after its timestamp and does not hold the transfer back: n - 1 sleeps count.
    added = (LONG // CHUNK - 1) * SLOWDOWN_MS / 1000.0
    assert slow_m["compute"] >= fast_m["compute"] + 0.7 * added, (slow_m, fast_m)
    # (additive, not a ratio: on a loaded box the normal prefill's own compute grows too)
    assert slow_m["kv_wait"] >= fast_m["kv_wait"] + 0.7 * added, (slow_m, fast_m)
    assert slow_m["kv_wait"] >= 0.9 * slow_m["compute"], slow_m
    # ... while the exposed transfer stays small: chunks were sent while later ones computed.
    assert slow_m["exposed"] <= 0.1 * slow_m["kv_wait"], slow_m
    assert slow_m["exposed"] <= fast_m["exposed"] + 0.1, (slow_m, fast_m)
    # Chunked transfer off: every page moves after the last chunk, so exposed transfer grows with the
    # prompt, and exceeds chunked-on's for the same prompt length (only the last chunk's pages are left).
    on_m = means(fast + slow)
    assert long_m["exposed"] > 1.5 * short_m["exposed"], (long_m, short_m)
    assert long_m["exposed"] > 1.5 * on_m["exposed"], (long_m, on_m)


# --- Must show 1 ----------------------------------------------------------------------------------

FACTS = ("Rivers carry water from the mountains to the sea, shaping valleys, feeding farms and towns, and "
         "giving homes to fish, birds and plants along their banks through every season of the year. ")


def _chat(http: str, model: str, messages: list[dict]) -> str:
    status, body = post_json(http, "/v1/chat/completions", {"model": model, "messages": messages,
                                                            "max_tokens": 8, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def _make_failures(o: Obs) -> None:
    """Conditions a healthy run does not produce, generated for real against the running services."""
    decode, prefill0 = o.grpc("decode-0"), o.grpc("prefill-0")

    async def rpcs() -> None:
        params = common_pb2.SamplingParams(max_tokens=4, temperature=0.0)
        async with create_channel(decode) as dch, create_channel(prefill0) as pch:
            # A reservation whose KV never comes: its 300 ms lease runs out (reservations expired).
            await decode_pb2_grpc.DecodeStub(dch).Reserve(decode_pb2.ReserveRequest(
                request_id="obs-expiring", token_ids=_prompt(40), params=params, lease_ms=300), timeout=30)
            # A prefill told to push KV for a reservation decode does not hold: decode rejects the first
            # chunk (unknown_reservation), prefill counts a transfer failure.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                    request_id="obs-lost", token_ids=_prompt(40), params=params, decode_address=decode,
                    reservation_id="rsv-gone", reservation_token=b"\x00" * 16), timeout=60)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND, e.value
            await asyncio.sleep(0.5)

    asyncio.run(rpcs())
    # A prompt no decode can hold: Reserve answers RESOURCE_EXHAUSTED, the client gets an error.
    with pytest.raises(grpc.RpcError) as e:
        _generate(o.cluster.router["grpc"], _prompt(TOO_LONG))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
    # The forwarded path to prefill-0 is cut: router-2's next request(s) there fail UNAVAILABLE before any
    # KV moved and are retried on prefill-0's direct address (round-robin: one of two goes there).
    o.forwarder.cut()
    for _ in range(2):
        _generate(o.router2["grpc"], _prompt(SHORT))


def _traffic(o: Obs) -> None:
    http = o.cluster.router["http"]
    # Multi-turn chat over both prefills (round-robin): each turn extends the last one, so decode already
    # holds the prefix (decode skip) and the other prefill loads its pages from the kvstore.
    messages: list[dict] = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"Part {turn}. {FACTS * 2} What follows from part {turn}?"})
        messages.append({"role": "assistant", "content": _chat(http, o.model, messages)})
        time.sleep(0.4)  # kvstore write-back is asynchronous
    # Concurrent requests, so queues and running batches are non-empty while scraped.
    threads = [threading.Thread(target=_generate, args=(r, _prompt(3 * CHUNK), 12))
               for r in (o.cluster.router["grpc"], o.router2["grpc"]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def test_every_dashboard_panel_has_data_from_a_live_cluster(obs: Obs) -> None:
    require_prometheus()
    targets = [obs.metrics(n) for n in ("router", "prefill-0", "prefill-1", "decode-0", "kvstore")]
    targets.append(obs.router2["metrics"])
    with PrometheusHarness(targets) as prom:
        prom.wait_for_scrapes(1)
        _make_failures(obs)
        _traffic(obs)
        # The conditions really happened (counted by the services themselves).
        r1, r2 = obs.metrics("router"), obs.router2["metrics"]
        assert metric_sum(r1, m.ROUTER_ERRORS_TOTAL, code="resource_exhausted") >= 1
        assert metric_sum(r2, m.ROUTER_DISPATCH_RETRIES_TOTAL, role="prefill", reason="unavailable") >= 1
        assert metric_sum(obs.metrics("prefill-0"), m.PREFILL_KV_TRANSFER_FAILURES_TOTAL) >= 1
        assert metric_sum(obs.metrics("decode-0"), m.DECODE_KV_CHUNKS_REJECTED_TOTAL,
                          reason="unknown_reservation") >= 1
        assert metric_sum(obs.metrics("decode-0"), m.DECODE_RESERVATIONS_EXPIRED_TOTAL) >= 1
        prefills = ("prefill-0", "prefill-1")
        from_store = sum(metric_sum(obs.metrics(p), m.PREFILL_CACHED_PREFIX_TOKENS_TOTAL, source="kvstore")
                         for p in prefills)
        skipped = sum(metric_sum(obs.metrics(p), m.PREFILL_KV_SKIPPED_TOKENS_TOTAL) for p in prefills)
        assert from_store > 0 and skipped > 0, (from_store, skipped)
        assert metric_sum(obs.metrics("kvstore"), m.KVSTORE_HITS_TOTAL) > 0
        # Let every series (the latest ones included) be scraped a few more times.
        time.sleep(4)
        started = time.monotonic()
        # This cluster does not speculate; test_spec_pd.py checks the speculation panel on one that does.
        exprs = [(where, expr) for where, expr in _exprs() if f"/ {SPEC_PANEL} /" not in where]
        failures = panel_failures(prom, exprs)
        print(f"\n{len(exprs)} panel queries evaluated in {time.monotonic() - started:.2f}s; targets "
              f"{json.dumps(prom.targets_health())}")
        assert not failures, "\n".join(failures)
