"""``python -m services.prefill``: the prefill service."""

from __future__ import annotations

import asyncio
import sys

import prometheus_client

from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2_grpc
from services.engine.kv_transport import make_transport
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.worker.engine_service import EngineService, service_main
from services.worker.stat_gauges import stat_gauges
from services.worker.step_metrics import StepMetrics


async def amain(cfg: PrefillConfig, ecfg) -> None:
    metrics = PrefillMetrics(prometheus_client.REGISTRY)
    # The descriptor stream (and page bytes unless shm/cuda-ipc writes them), over mTLS when configured.
    transport = make_transport("grpc", tls=cfg if cfg.tls_enabled else None, max_message_bytes=cfg.max_message_bytes)
    service = EngineService("prefill", cfg, ecfg)
    servicer = PrefillServicer(cfg, metrics, transport, asyncio.Event())
    service.on_stats.append(stat_gauges(metrics, lambda: servicer.model))
    service.on_stats.append(StepMetrics(metrics, lambda: service.engine, lambda: servicer.model))
    service.on_close.append(transport.close)
    service.on_close.append(servicer.close)
    await service.run(servicer, prefill_pb2_grpc.add_PrefillServicer_to_server)


def main(argv: list[str] | None = None) -> int:
    return service_main("prefill", PrefillConfig, amain, argv, "The prefill service.")


if __name__ == "__main__":
    sys.exit(main())
