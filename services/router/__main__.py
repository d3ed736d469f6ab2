"""``python -m services.router``: the router (OpenAI HTTP + gRPC Router API)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import prometheus_client
from aiohttp import web

from services.common.admin import AdminServicer, PythonTraceCapture
from services.common.config import ConfigError
from services.common.config_file import parse_settings
from services.common.logging import LoggingConfig, setup_logging
from services.common.metric_series import initialise
from services.common.metrics import RouterMetrics
from services.common.pb import common_pb2_grpc, router_pb2_grpc
from services.common.server import (
    ServiceServer,
    StartupError,
    check_ports,
    connectable_host,
    run_main,
    serve,
    server_ports,
)
from services.common.tracing import TracingUnavailableError
from services.router.auth import APIKeys
from services.router.config import RouterConfig
from services.router.dispatch import DisaggregatedBackend, DispatchSettings
from services.router.instances import InstancePool
from services.router.metering import RequestMeter
from services.router.openai_http import make_app, make_runner
from services.router.pipeline import TextPipeline
from services.router.servicer import RouterServicer
from services.text.model.errors import ModelLoadError
from services.text.model.source import load_tokenizer

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 5.0
"""While waiting for backends at start, a progress line this often (seconds)."""


async def amain(cfg: RouterConfig, api_keys: APIKeys | None = None) -> None:
    # Before anything slow: every port this router will bind is free.
    check_ports([*server_ports(cfg), (cfg.http_host, cfg.http_port, "--http-port / PDSERVE_HTTP_PORT")])
    t0 = time.monotonic()
    log.info("router: reading the tokenizer and chat template of %s", cfg.model or "the embedded default model")
    try:
        tok, model_id, model_len = await asyncio.to_thread(load_tokenizer, cfg.model)
    except ModelLoadError as e:
        raise StartupError(f"--model / PDSERVE_MODEL: {e}") from e
    max_len = min(cfg.max_model_len or model_len, model_len)
    served = cfg.served_model_name or model_id
    log.info("router: tokenizer of %s read in %.1f s (vocab %d, context %d tokens), served as %r",
             model_id, time.monotonic() - t0, tok.vocab_size, max_len, served)
    metrics = RouterMetrics(prometheus_client.REGISTRY)

    def on_health(inst) -> None:
        metrics.instance_healthy.labels(inst.role, inst.address).set(1 if inst.healthy else 0)

    prefill_targets = RouterConfig.targets(cfg.prefill)
    pool_args = dict(health_interval_s=cfg.health_interval_s, dead_after_s=cfg.dead_after_s,
                     resolve_interval_s=cfg.resolve_interval_s, tls=cfg if cfg.tls_enabled else None,
                     on_health=on_health)
    decode_pool = InstancePool("decode" if prefill_targets else "worker", RouterConfig.targets(cfg.decode),
                               **pool_args)
    prefill_pool = InstancePool("prefill", prefill_targets, **pool_args) if prefill_targets else None
    backend = DisaggregatedBackend(prefill_pool, decode_pool, DispatchSettings.from_config(cfg), metrics, served)
    initialise(metrics, model=(served,), role=("prefill", "decode") if prefill_targets else ("worker",))
    pipeline = TextPipeline(tok, backend, max_len)
    runner: web.AppRunner | None = None
    pools = [p for p in (prefill_pool, decode_pool) if p is not None]

    async def shutdown() -> None:
        if runner is not None:
            await runner.cleanup()
        await backend.close()
        for p in pools:
            await p.close()

    srv = ServiceServer("router", cfg, on_shutdown=shutdown)
    # One admission bound and one set of request counters for both APIs.
    meter = RequestMeter(metrics, served, max_inflight=cfg.max_inflight_requests, access_log=cfg.access_log)
    srv.add_service(router_pb2_grpc.add_RouterServicer_to_server,
                    RouterServicer(pipeline, metrics, served, srv.draining, meter=meter, api_keys=api_keys,
                                   request_timeout_s=cfg.request_timeout_s))

    async def load() -> dict[str, float]:
        return {"running": meter.inflight, "max_waiting": meter.max_inflight, "published_unix": time.time(),
                "saturated": float(meter.inflight >= meter.max_inflight)}

    trace = PythonTraceCapture("router", cfg.instance or f"{cfg.host}:{cfg.port}", cfg.trace_dir)
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, AdminServicer(load, trace))

    def ready() -> bool:
        return not srv.draining.is_set() and all(p.healthy() for p in pools)

    async def warmup() -> None:
        nonlocal runner
        trace.instance = srv.instance
        for p in pools:
            await p.start()
        started = said = time.monotonic()
        for _ in range(100):  # the workers may still be loading their model
            await asyncio.gather(*(p.check_now() for p in pools))
            if ready():
                break
            if time.monotonic() - said >= PROGRESS_EVERY_S:
                said = time.monotonic()
                log.info("router: waiting for backends (%.0f s): %s", said - started,
                         ", ".join(f"{p.role} {len(p.healthy())}/{len(p.instances)} up" for p in pools))
            await asyncio.sleep(0.2)
        log.info("router: backends %s", ", ".join(f"{p.role} {len(p.healthy())}/{len(p.instances)} up"
                                                  for p in pools))
        app = make_app(pipeline, max_body_bytes=cfg.max_body_bytes, ready=ready, meter=meter, api_keys=api_keys,
                       read_timeout_s=cfg.http_read_timeout_s, request_timeout_s=cfg.request_timeout_s,
                       registry=prometheus_client.REGISTRY)  # /metrics on the API port too
        runner = make_runner(app)
        await runner.setup()
        site = web.TCPSite(runner, cfg.http_host, cfg.http_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the bound port when http_port is 0
        srv.extra_ready["http"] = f"{connectable_host(cfg.http_host)}:{port}"

    await serve(srv, warmup=warmup)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, lcfg = parse_settings([RouterConfig, LoggingConfig], argv, prog="pdserve router", section="router",
                                   description="The router: OpenAI HTTP and gRPC APIs.")
        api_keys = APIKeys.load(cfg.api_key, cfg.api_key_file)
    except (ConfigError, ValueError) as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    setup_logging("router", lcfg)
    try:
        cfg.setup_tracing("pdserve-router")
    except TracingUnavailableError as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2
    return run_main("router", amain(cfg, api_keys))


if __name__ == "__main__":
    sys.exit(main())
