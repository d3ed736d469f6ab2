"""One request, one trace: router, prefill and decode spans share a trace id across the gRPC hops.

The in-memory exporter only sees spans of its own process, so the three services run in one process
(a fresh interpreter started by the test), as real grpc.aio servers on loopback built from the real servicers (wired as their
``__main__`` modules wire them), each with its own metrics registry; the request crosses real gRPC
calls (Router.Generate -> Decode.Reserve/Generate + Prefill.Prefill -> Decode.PushKV), so trace
context can only arrive through gRPC metadata.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common import tracing
from services.common.grpc_util import create_channel
from services.common.metrics import DecodeMetrics, PrefillMetrics, RouterMetrics
from services.common.pb import (
    common_pb2,
    common_pb2_grpc,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from services.common.server import ServiceServer
from services.decode.config import DecodeConfig
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.kv_transport import make_transport
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.router.config import RouterConfig
from services.router.dispatch import DisaggregatedBackend, DispatchSettings
from services.router.instances import InstancePool
from services.router.pipeline import TextPipeline
from services.router.servicer import RouterServicer
from services.text.model.source import load_tokenizer
from services.worker.admin import AdminServicer, TraceCapture

pytest.importorskip("opentelemetry.sdk")
pytestmark = pytest.mark.e2e

MODEL = "random:tiny-llama"  # real engine and servicers, instant weights; same spec on both sides -> same layout
ENGINE = dict(model=MODEL, dtype="float32", kv_cache_bytes=4 << 20, max_prefill_chunk=16)
SERVER = dict(host="127.0.0.1", port=0, metrics_port=-1, drain_timeout_s=1.0, grace_s=0.5)


async def _engine_server(name: str, cfg: Any, servicer: Any, add: Callable[[Any, Any], None],
                         engine: AsyncEngine) -> ServiceServer:
    """As services.worker.engine_service.EngineService wires it: servicer + Admin, SERVING once bound."""
    srv = ServiceServer(name, cfg, drain=servicer.drain)
    servicer.draining = srv.draining
    srv.add_service(add, servicer)
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server,
                    AdminServicer(lambda: engine.stats(), TraceCapture(name, name)))
    await srv.start()
    servicer.bind(engine)
    await srv.set_serving()
    return srv


async def _one_traced_request() -> tuple[list[Any], common_pb2.GenerateResponse]:
    decode_engine = await asyncio.to_thread(AsyncEngine, EngineConfig(**ENGINE))
    prefill_engine = await asyncio.to_thread(AsyncEngine, EngineConfig(**ENGINE))
    servers: list[ServiceServer] = []
    pools: list[InstancePool] = []
    transport = make_transport("grpc")
    try:
        decode = DecodeServicer(DecodeConfig(**SERVER), DecodeMetrics(CollectorRegistry()), asyncio.Event())
        servers.append(await _engine_server("decode", DecodeConfig(**SERVER), decode,
                                            decode_pb2_grpc.add_DecodeServicer_to_server, decode_engine))
        prefill = PrefillServicer(PrefillConfig(**SERVER), PrefillMetrics(CollectorRegistry()), transport,
                                  asyncio.Event())
        servers.append(await _engine_server("prefill", PrefillConfig(**SERVER), prefill,
                                            prefill_pb2_grpc.add_PrefillServicer_to_server, prefill_engine))

        # The router, as services/router/__main__.py wires it.
        rcfg = RouterConfig(**SERVER, decode=servers[0].grpc_address, prefill=servers[1].grpc_address,
                            policy="round_robin")
        metrics = RouterMetrics(CollectorRegistry())
        tok, model_id, max_len = load_tokenizer(MODEL)
        decode_pool = InstancePool("decode", RouterConfig.targets(rcfg.decode))
        prefill_pool = InstancePool("prefill", RouterConfig.targets(rcfg.prefill))
        pools += [prefill_pool, decode_pool]
        backend = DisaggregatedBackend(prefill_pool, decode_pool, DispatchSettings(policy=rcfg.policy), metrics,
                                       model_id)
        router = ServiceServer("router", rcfg)
        router.add_service(router_pb2_grpc.add_RouterServicer_to_server,
                           RouterServicer(TextPipeline(tok, backend, max_len), metrics, model_id, router.draining))
        servers.append(router)
        await router.start()
        for p in pools:
            await p.start()
            await p.check_now()
            assert p.healthy(), f"{p.role} not healthy"
        await router.set_serving()

        tracing.memory_exporter().clear()  # type: ignore[union-attr]  # only this request's spans
        async with create_channel(router.grpc_address) as ch:
            call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
                text="The quick brown fox jumps over the lazy dog, again and again and again.",
                params=common_pb2.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=60)
            responses = [r async for r in call]
        # Server spans end just after the last message is sent: give them a moment.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            names = {s.name for s in tracing.finished_spans()}
            if {"router.request", "prefill.request", "decode.generate", "decode.kv_push"} <= names:
                break
            await asyncio.sleep(0.05)
        return tracing.finished_spans(), responses[-1]
    finally:
        for p in pools:
            await p.close()
        for srv in reversed(servers):
            await srv.shutdown("test over", force=True)
        await transport.close()
        for e in (prefill_engine, decode_engine):
            e.shutdown()


def _traced_request_in_fresh_process() -> tuple[list[dict[str, Any]], int]:
    """Run the three services and one request in a new interpreter (several grpc.aio servers and event
    loops in the long-lived pytest process have crashed grpc's C core); returns its finished spans."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True,
                          timeout=300, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["spans"], result["completion_tokens"]


def _run_and_dump() -> None:
    tracing.setup_tracing("pdserve-e2e", "memory")
    try:
        spans, last = asyncio.run(_one_traced_request())
    finally:
        tracing.shutdown_tracing()
    print(json.dumps({"completion_tokens": last.usage.completion_tokens, "spans": [
        {"name": s.name, "trace_id": f"{s.context.trace_id:032x}", "span_id": s.context.span_id,
         "parent": s.parent.span_id if s.parent else None, "remote": bool(s.parent and s.parent.is_remote)}
        for s in spans]}))


def test_one_request_gives_one_trace_across_router_prefill_and_decode() -> None:
    spans, completion_tokens = _traced_request_in_fresh_process()
    assert completion_tokens == 6

    by_name: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        by_name.setdefault(s["name"], []).append(s)
    summary = sorted((s["name"], s["trace_id"], s["parent"]) for s in spans)
    for prefix in ("router.", "prefill.", "decode."):
        assert any(n.startswith(prefix) for n in by_name), f"no {prefix}* span: {summary}"
    assert len({s["trace_id"] for s in spans}) == 1, f"more than one trace: {summary}"

    ids = {s["span_id"]: s for s in spans}

    def parent(name: str) -> dict[str, Any]:
        (s,) = by_name[name]
        assert s["parent"] is not None and s["parent"] in ids, f"{name} has no parent in the trace: {summary}"
        return ids[s["parent"]]

    (root,) = by_name["router.request"]
    assert root["parent"] is None  # the client sent no context: the router starts the trace
    # Server spans in prefill and decode are children of router-side spans: context crossed the hops.
    assert parent("prefill.request")["name"] == "router.prefill"
    assert parent("router.prefill")["name"] == "router.request"
    assert parent("decode.generate")["name"] == "router.request"
    # The parents arrived through gRPC metadata (extracted: remote), not through this process' context.
    assert all(by_name[n][0]["remote"] for n in ("prefill.request", "decode.generate", "decode.kv_push"))
    # ... and the KV push, opened by prefill, is a child of prefill's span in decode.
    assert parent("decode.kv_push")["name"] == "prefill.request"


if __name__ == "__main__":
    _run_and_dump()
