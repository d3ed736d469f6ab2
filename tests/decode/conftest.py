"""Decode fixtures: the decode servicer over a small random-weight engine on a real grpc.aio server
(127.0.0.1, ephemeral port), either bare (``decode_rig``) or inside the real service lifecycle with
health, Admin and shutdown (``decode_service``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.grpc_util import wait_for_serving
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2_grpc, decode_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.pushkv_wire import add_decode_servicer
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.core_client import EngineCoreClient
from services.worker.engine_service import EngineDiedError, EngineService
from tests.decode.kv_util import ecfg

SERVER = dict(host="127.0.0.1", port=0, metrics_port=-1, drain_timeout_s=10.0, grace_s=2.0,
              engine_core="thread")  # these rigs reach the engine in-process; test_engine_core.py asks for "process"


@dataclass
class Rig:
    servicer: DecodeServicer
    stub: decode_pb2_grpc.DecodeStub
    registry: CollectorRegistry
    channel: grpc.aio.Channel
    extra: list = field(default_factory=list)

    @property
    def engine(self) -> AsyncEngine:
        return self.servicer.engine

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def decode_rig() -> AsyncIterator[Callable[..., Awaitable[Rig]]]:
    """``await decode_rig(engine=dict(...), **config_fields)``: a bound DecodeServicer served on 127.0.0.1:0."""
    made: list[tuple[Rig, grpc.aio.Server]] = []

    async def make(engine: dict | None = None, **cfg: object) -> Rig:
        registry = CollectorRegistry()
        config = DecodeConfig(**{**SERVER, **cfg})
        servicer = DecodeServicer(config, DecodeMetrics(registry), asyncio.Event())
        if config.engine_core == "process":  # the step loop in an engine-core process of its own
            servicer.bind(await EngineCoreClient.start(ecfg(**(engine or {})), "decode"))
        else:
            servicer.bind(await asyncio.to_thread(AsyncEngine, ecfg(**(engine or {}))))
        server = grpc.aio.server()
        add_decode_servicer(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        rig = Rig(servicer, decode_pb2_grpc.DecodeStub(channel), registry, channel)
        made.append((rig, server))
        return rig

    yield make
    for rig, server in made:
        await rig.channel.close()
        await server.stop(None)
        await rig.servicer.close()
        await asyncio.to_thread(rig.servicer.engine.shutdown)


@dataclass
class Service:
    service: EngineService
    servicer: DecodeServicer
    task: asyncio.Task
    channel: grpc.aio.Channel
    registry: CollectorRegistry

    @property
    def stub(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel)

    @property
    def admin(self) -> common_pb2_grpc.AdminStub:
        return common_pb2_grpc.AdminStub(self.channel)

    @property
    def engine(self) -> AsyncEngine:
        assert self.service.engine is not None
        return self.service.engine


@pytest.fixture
async def decode_service() -> AsyncIterator[Callable[..., Awaitable[Service]]]:
    """``await decode_service(**config_fields)``: EngineService("decode") running in-process until SERVING."""
    made: list[Service] = []

    async def make(engine: dict | None = None, **cfg: object) -> Service:
        config = DecodeConfig(**{**SERVER, **cfg})
        registry = CollectorRegistry()
        svc = EngineService("decode", config, ecfg(**(engine or {})))
        servicer = DecodeServicer(config, DecodeMetrics(registry), asyncio.Event())
        task = asyncio.create_task(svc.run(servicer, add_decode_servicer))
        for _ in range(200):
            if svc.server is not None and svc.server.grpc_port:
                break
            await asyncio.sleep(0.05)
        assert svc.server is not None and svc.server.grpc_port, "the decode service did not start"
        await wait_for_serving(svc.server.grpc_address, 60)
        s = Service(svc, servicer, task, grpc.aio.insecure_channel(svc.server.grpc_address), registry)
        made.append(s)
        return s

    yield make
    for s in made:
        await s.channel.close()
        if not s.task.done() and s.service.server is not None:
            await s.service.server.shutdown("test over", force=True)
        with contextlib.suppress(EngineDiedError):
            await s.task
