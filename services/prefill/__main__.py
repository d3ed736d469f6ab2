"""``python -m services.prefill``: the prefill service."""

from __future__ import annotations

import argparse
import asyncio
import sys

import prometheus_client

from services.common import tracing
from services.common.admin import AdminServicer, TraceCapture
from services.common.config import ConfigError, add_dataclass_args, from_args
from services.common.logging import LoggingConfig, setup_logging
from services.common.metrics import PrefillMetrics
from services.common.pb import common_pb2_grpc, prefill_pb2_grpc
from services.common.server import ServiceServer, serve
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.kv_transport import make_transport


async def amain(cfg: PrefillConfig, ecfg: EngineConfig) -> None:
    metrics = PrefillMetrics(prometheus_client.REGISTRY)
    holder: dict[str, AsyncEngine] = {}
    servicer: PrefillServicer

    transport = make_transport(cfg.kv_transport)

    async def shutdown() -> None:
        await transport.close()
        if "engine" in holder:
            holder["engine"].shutdown()

    srv = ServiceServer("prefill", cfg, drain=lambda: servicer.drain(), on_shutdown=shutdown)
    servicer = PrefillServicer(cfg, metrics, transport, srv.draining)
    srv.add_service(prefill_pb2_grpc.add_PrefillServicer_to_server, servicer)

    async def load() -> dict[str, float]:
        if "engine" not in holder:
            raise RuntimeError("model loading")
        s = await holder["engine"].stats()
        model = servicer.model
        metrics.running_requests.labels(model).set(s["running"])
        metrics.waiting_requests.labels(model).set(s["waiting"])
        return s

    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server,
                    AdminServicer(load, TraceCapture("prefill", cfg.instance or f"{cfg.host}:{cfg.port}")))

    async def warmup() -> None:
        engine = await asyncio.to_thread(AsyncEngine, ecfg)
        holder["engine"] = engine
        servicer.bind(engine)
        asyncio.get_running_loop().create_task(_gauges(load))

    await serve(srv, warmup=warmup)


async def _gauges(load) -> None:
    while True:
        await load()
        await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve prefill", description="The prefill service.")
    for cls in (PrefillConfig, EngineConfig, LoggingConfig):
        add_dataclass_args(p, cls)
    ns = p.parse_args(argv)
    try:
        cfg, ecfg, lcfg = from_args(PrefillConfig, ns), from_args(EngineConfig, ns), from_args(LoggingConfig, ns)
    except (ConfigError, ValueError) as e:
        print(f"pdserve prefill: {e}", file=sys.stderr)
        return 2
    setup_logging("prefill", lcfg)
    tracing.setup_tracing("pdserve-prefill", cfg.tracing, cfg.otlp_endpoint or None)
    asyncio.run(amain(cfg, ecfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
