"""``python -m services.decode``: the decode service."""

from __future__ import annotations

import asyncio
import sys

import prometheus_client

from services.common.metrics import DecodeMetrics
from services.decode.config import DecodeConfig
from services.decode.pushkv_wire import add_decode_servicer
from services.decode.servicer import DecodeServicer
from services.worker.engine_service import EngineService, service_main
from services.worker.stat_gauges import stat_gauges
from services.worker.step_metrics import StepMetrics


async def amain(cfg: DecodeConfig, ecfg) -> None:
    metrics = DecodeMetrics(prometheus_client.REGISTRY)
    service = EngineService("decode", cfg, ecfg)
    servicer = DecodeServicer(cfg, metrics, asyncio.Event())
    service.on_stats.append(stat_gauges(metrics, lambda: servicer.model))
    service.on_stats.append(StepMetrics(metrics, lambda: service.engine, lambda: servicer.model))
    service.on_close.append(servicer.close)
    await service.run(servicer, add_decode_servicer)


def main(argv: list[str] | None = None) -> int:
    return service_main("decode", DecodeConfig, amain, argv, "The decode service.")


if __name__ == "__main__":
    sys.exit(main())
