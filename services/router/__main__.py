"""``python -m services.router``: the router (OpenAI HTTP + gRPC Router API)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import prometheus_client
from aiohttp import web

from services.common.config import ConfigError, add_dataclass_args, from_args
from services.common.logging import LoggingConfig, setup_logging
from services.common.metrics import RouterMetrics
from services.common.pb import router_pb2_grpc
from services.common.server import ServiceServer, connectable_host, serve
from services.engine.model_source import load_tokenizer
from services.router.auth import APIKeys
from services.router.config import RouterConfig
from services.router.dispatch import DisaggregatedBackend, DispatchSettings
from services.router.instances import InstancePool
from services.router.metering import RequestMeter
from services.router.openai_http import make_app, make_runner
from services.router.pipeline import TextPipeline
from services.router.servicer import RouterServicer


async def amain(cfg: RouterConfig, api_keys: APIKeys | None = None) -> None:
    metrics = RouterMetrics(prometheus_client.REGISTRY)
    tok, model_id, max_len = await asyncio.to_thread(load_tokenizer, cfg.model)
    served = cfg.served_model_name or model_id

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
    meter = RequestMeter(metrics, served, max_inflight=cfg.max_inflight_requests)
    srv.add_service(router_pb2_grpc.add_RouterServicer_to_server,
                    RouterServicer(pipeline, metrics, served, srv.draining, meter=meter, api_keys=api_keys,
                                   request_timeout_s=cfg.request_timeout_s))

    def ready() -> bool:
        return not srv.draining.is_set() and all(p.healthy() for p in pools)

    async def warmup() -> None:
        nonlocal runner
        for p in pools:
            await p.start()
        for _ in range(100):  # the workers may still be loading their model
            await asyncio.gather(*(p.check_now() for p in pools))
            if ready():
                break
            await asyncio.sleep(0.2)
        app = make_app(pipeline, max_body_bytes=cfg.max_body_bytes, ready=ready, meter=meter, api_keys=api_keys,
                       read_timeout_s=cfg.http_read_timeout_s, request_timeout_s=cfg.request_timeout_s)
        runner = make_runner(app)
        await runner.setup()
        site = web.TCPSite(runner, cfg.http_host, cfg.http_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the bound port when http_port is 0
        srv.extra_ready["http"] = f"{connectable_host(cfg.http_host)}:{port}"

    await serve(srv, warmup=warmup)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve router", description="The router: OpenAI HTTP and gRPC APIs.")
    for cls in (RouterConfig, LoggingConfig):
        add_dataclass_args(p, cls)
    ns = p.parse_args(argv)
    try:
        cfg, lcfg = from_args(RouterConfig, ns), from_args(LoggingConfig, ns)
        api_keys = APIKeys.load(cfg.api_key, cfg.api_key_file)
    except (ConfigError, ValueError) as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    setup_logging("router", lcfg)
    cfg.setup_tracing("pdserve-router")
    asyncio.run(amain(cfg, api_keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
