"""``pdserve kvstore`` / ``python -m services.kvstore``: run the kvstore gRPC service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Sequence

import prometheus_client

from services.common.admin import AdminServicer, PythonTraceCapture
from services.common.config import ConfigError, config_dict
from services.common.config_file import parse_settings
from services.common.logging import LoggingConfig, setup_logging
from services.common.metric_series import initialise
from services.common.metrics import KVStoreMetrics
from services.common.pb import common_pb2_grpc
from services.common.pb import kvstore_pb2_grpc as pb_grpc
from services.common.server import ServiceServer, check_ports, run_main, serve, server_ports
from services.kvstore.backend import KVStoreBackend
from services.kvstore.config import KVStoreConfig
from services.kvstore.servicer import KVStoreServicer

log = logging.getLogger(__name__)


async def build_backend(cfg: KVStoreConfig) -> KVStoreBackend:
    """The configured backend, opened (the embedded disk index is rebuilt in a worker thread)."""
    if cfg.backend == "mooncake":
        # deferred: the Mooncake wheel is an optional dependency, loaded only for its backend
        from services.kvstore.mooncake_backend import MooncakeBackend, MooncakeSettings

        settings = MooncakeSettings(
            master_address=cfg.mooncake_master, local_hostname=cfg.mooncake_local_hostname,
            metadata_server=cfg.mooncake_metadata_server, global_segment_bytes=cfg.mooncake_segment_bytes,
            local_buffer_bytes=cfg.mooncake_buffer_bytes, protocol=cfg.mooncake_protocol,
            device=cfg.mooncake_device, op_timeout_s=cfg.mooncake_op_timeout_s)
        return await MooncakeBackend(settings).open()
    # deferred: the embedded backend's modules, only when it is the one configured
    from services.kvstore.embedded import EmbeddedBackend

    return await asyncio.to_thread(EmbeddedBackend, cfg.memory_bytes, cfg.disk_dir, cfg.disk_bytes)


class KVStoreService:
    """The servicer is registered at once (health NOT_SERVING); the backend opens during warmup."""

    def __init__(self, cfg: KVStoreConfig) -> None:
        self.cfg = cfg
        self.server = ServiceServer("kvstore", cfg, on_shutdown=self.close)
        self.servicer = KVStoreServicer(None, max_page_bytes=cfg.max_page_bytes, piece_bytes=cfg.piece_bytes,
                                        draining=self.server.draining,
                                        max_inflight_put_bytes=cfg.max_inflight_put_bytes,
                                        put_idle_timeout_s=cfg.put_idle_timeout_s, tls_on=cfg.tls_enabled)
        self.server.add_service(pb_grpc.add_KVStoreServicer_to_server, self.servicer)
        self.trace = PythonTraceCapture("kvstore", cfg.instance or f"{cfg.host}:{cfg.port}", cfg.trace_dir)
        self.server.add_service(common_pb2_grpc.add_AdminServicer_to_server, AdminServicer(self.load, self.trace))
        self.metrics = KVStoreMetrics(prometheus_client.REGISTRY)
        self._last: dict[str, dict[str, int]] = {}
        self._last_io: dict[str, int] = {}
        self._last_refused: dict[str, int] = {}
        self._metrics_task: asyncio.Task | None = None

    async def load(self) -> dict[str, float]:
        """Admin.GetLoad: open Put streams' bytes against the quota (saturated when it is used up) and the
        first tier's fill. RuntimeError (UNAVAILABLE/LOADING) until the backend is open."""
        backend = self.servicer.backend
        if backend is None:
            raise RuntimeError("kvstore backend opening")
        tiers = backend.stats().tiers
        capacity = tiers[0].capacity_bytes if tiers else 0
        quota = self.servicer.quota
        return {"published_unix": time.time(), "saturated": float(quota.used >= quota.limit > 0),
                "kv_usage": (tiers[0].bytes / capacity) if capacity else 0.0}

    async def warmup(self) -> None:
        self.trace.instance = self.server.instance
        t0 = time.monotonic()
        log.info("kvstore: opening the %s backend", self.cfg.backend)
        self.servicer.backend = await build_backend(self.cfg)
        tiers = self.servicer.backend.stats().tiers
        initialise(self.metrics, tier=tuple(t.name for t in tiers))
        log.info("kvstore: %s backend open in %.1f s, tiers %s", self.cfg.backend, time.monotonic() - t0,
                 ", ".join(f"{t.name} ({t.entries} pages, {t.bytes / 2**20:.0f} MiB)" for t in tiers))
        await self.export_metrics()
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())

    async def export_metrics(self) -> None:
        """Mirror the backend's cumulative counters into Prometheus (counters advance by the delta)."""
        m, stats = self.metrics, self.servicer.backend.stats()
        for t in stats.tiers:
            last = self._last.get(t.name, {})
            for field, counter in (("hits", m.hits_total), ("misses", m.misses_total),
                                   ("evictions", m.evictions_total), ("corrupt", m.corrupt_total)):
                value = getattr(t, field)
                counter.labels(t.name).inc(max(0, value - last.get(field, 0)))
                last[field] = value
            self._last[t.name] = last
            m.stored_bytes.labels(t.name).set(t.bytes)
            m.entries.labels(t.name).set(t.entries)
        for name, counter in (("get", m.get_bytes_total), ("put", m.put_bytes_total)):
            value = getattr(self.servicer, f"{name}_bytes")
            counter.inc(max(0, value - self._last_io.get(name, 0)))
            self._last_io[name] = value
        for reason, value in list(self.servicer.put_refused.items()):
            m.put_refused_total.labels(reason).inc(max(0, value - self._last_refused.get(reason, 0)))
            self._last_refused[reason] = value
        m.put_inflight_bytes.set(self.servicer.quota.used)

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            await self.export_metrics()

    async def close(self) -> None:
        if self._metrics_task is not None:
            self._metrics_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._metrics_task
        if self.servicer.backend is not None:
            await self.servicer.backend.close()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg, log_cfg = parse_settings([KVStoreConfig, LoggingConfig], argv, prog="pdserve kvstore", section="kvstore",
                                      description=(KVStoreConfig.__doc__ or "").strip())
    except (ConfigError, ValueError) as e:
        print(f"pdserve kvstore: {e}", file=sys.stderr)
        return 2
    setup_logging("kvstore", log_cfg)
    log.info("kvstore config: %s", config_dict(cfg))

    async def run() -> None:
        check_ports(server_ports(cfg))
        service = KVStoreService(cfg)
        await serve(service.server, warmup=service.warmup)

    return run_main("kvstore", run())


if __name__ == "__main__":
    sys.exit(main())
