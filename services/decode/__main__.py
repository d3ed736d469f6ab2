"""``python -m services.decode``: the decode service."""

from __future__ import annotations

import argparse
import asyncio
import sys

import prometheus_client

from services.common import tracing
from services.common.admin import AdminServicer, TraceCapture
from services.common.config import ConfigError, add_dataclass_args, from_args
from services.common.logging import LoggingConfig, setup_logging
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2_grpc, decode_pb2_grpc
from services.common.server import ServiceServer, serve
from services.decode.config import DecodeConfig
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig


async def amain(cfg: DecodeConfig, ecfg: EngineConfig) -> None:
    metrics = DecodeMetrics(prometheus_client.REGISTRY)
    holder: dict[str, AsyncEngine] = {}
    servicer: DecodeServicer

    def shutdown() -> None:
        if "engine" in holder:
            holder["engine"].shutdown()

    srv = ServiceServer("decode", cfg, drain=lambda: servicer.drain(), on_shutdown=shutdown)
    servicer = DecodeServicer(cfg, metrics, srv.draining)
    srv.add_service(decode_pb2_grpc.add_DecodeServicer_to_server, servicer)

    async def load() -> dict[str, float]:
        if "engine" not in holder:
            raise RuntimeError("model loading")
        s = await holder["engine"].stats()
        model = servicer.model
        metrics.kv_cache_usage_ratio.labels(model).set(s["kv_usage"])
        metrics.running_requests.labels(model).set(s["running"])
        metrics.waiting_requests.labels(model).set(s["waiting"])
        metrics.waiting_for_kv_requests.labels(model).set(s["waiting_for_kv"])
        return s

    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server,
                    AdminServicer(load, TraceCapture("decode", cfg.instance or f"{cfg.host}:{cfg.port}")))

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
    p = argparse.ArgumentParser(prog="pdserve decode", description="The decode service.")
    for cls in (DecodeConfig, EngineConfig, LoggingConfig):
        add_dataclass_args(p, cls)
    ns = p.parse_args(argv)
    try:
        cfg, ecfg, lcfg = from_args(DecodeConfig, ns), from_args(EngineConfig, ns), from_args(LoggingConfig, ns)
    except (ConfigError, ValueError) as e:
        print(f"pdserve decode: {e}", file=sys.stderr)
        return 2
    setup_logging("decode", lcfg)
    tracing.setup_tracing("pdserve-decode", cfg.tracing, cfg.otlp_endpoint or None)
    asyncio.run(amain(cfg, ecfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
