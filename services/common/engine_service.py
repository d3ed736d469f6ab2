"""Lifecycle shared by the engine-backed services (prefill, decode): NOT_SERVING while the model
loads on a worker thread, Admin (load reports, trace capture), load gauges, engine shutdown."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import tracing
from services.common.admin import AdminServicer, TraceCapture
from services.common.config import ConfigError, add_dataclass_args, from_args
from services.common.logging import LoggingConfig, setup_logging
from services.common.pb import common_pb2_grpc
from services.common.server import ServerConfig, ServiceServer, serve
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig

GAUGE_PERIOD_S = 1.0


class EngineService:
    """Wires one servicer (with ``bind(engine)`` and ``drain()``) to a ServiceServer."""

    def __init__(self, name: str, cfg: ServerConfig, ecfg: EngineConfig) -> None:
        self.name = name
        self.cfg = cfg
        self.ecfg = ecfg
        self.engine: AsyncEngine | None = None
        self.on_stats: list[Callable[[dict[str, float]], None]] = []
        self.on_close: list[Callable[[], Awaitable[None]]] = []

    async def stats(self) -> dict[str, float]:
        if self.engine is None:
            raise RuntimeError("model loading")
        s = await self.engine.stats()
        for fn in self.on_stats:
            fn(s)
        return s

    async def _gauges(self) -> None:
        while True:
            await self.stats()
            await asyncio.sleep(GAUGE_PERIOD_S)

    async def run(self, servicer: Any, add_to_server: Callable[[Any, Any], None]) -> None:
        async def shutdown() -> None:
            for fn in self.on_close:
                await fn()
            if self.engine is not None:
                self.engine.shutdown()

        srv = ServiceServer(self.name, self.cfg, drain=servicer.drain, on_shutdown=shutdown)
        servicer.draining = srv.draining
        srv.add_service(add_to_server, servicer)
        trace = TraceCapture(self.name, self.cfg.instance or f"{self.cfg.host}:{self.cfg.port}")
        srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, AdminServicer(self.stats, trace))

        async def warmup() -> None:
            trace.instance = srv.instance  # the bound address (port 0 picks one at start)
            self.engine = await asyncio.to_thread(AsyncEngine, self.ecfg)
            servicer.bind(self.engine)
            await self.stats()
            asyncio.get_running_loop().create_task(self._gauges())

        await serve(srv, warmup=warmup)


def parse_service_args(name: str, config_cls: type, argv: list[str] | None, description: str
                       ) -> tuple[Any, EngineConfig] | None:
    """Flags of the service's config + EngineConfig + logging; sets up logging and tracing."""
    p = argparse.ArgumentParser(prog=f"pdserve {name}", description=description)
    for cls in (config_cls, EngineConfig, LoggingConfig):
        add_dataclass_args(p, cls)
    ns = p.parse_args(argv)
    try:
        cfg, ecfg, lcfg = from_args(config_cls, ns), from_args(EngineConfig, ns), from_args(LoggingConfig, ns)
    except (ConfigError, ValueError) as e:
        print(f"pdserve {name}: {e}", file=sys.stderr)
        return None
    setup_logging(name, lcfg)
    tracing.setup_tracing(f"pdserve-{name}", cfg.tracing, cfg.otlp_endpoint or None)
    return cfg, ecfg


def service_main(name: str, config_cls: type, amain: Callable[[Any, EngineConfig], Awaitable[None]],
                 argv: list[str] | None, description: str) -> int:
    """The ``main`` of an engine-backed service: parse flags, then run ``amain(cfg, engine_cfg)``."""
    parsed = parse_service_args(name, config_cls, argv, description)
    if parsed is None:
        return 2
    asyncio.run(amain(*parsed))
    return 0
