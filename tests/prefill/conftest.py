"""Prefill service rigs: a real PrefillServicer and engine (random tiny Llama, fp32) on a grpc.aio server
on an ephemeral loopback port, handing KV to an in-process recording receiver (FakeTransport)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from services.common.grpc_util import create_channel
from services.common.metrics import PrefillMetrics
from services.common.pb import common_pb2, decode_pb2, prefill_pb2, prefill_pb2_grpc
from services.common.tls import TLSConfig
from services.engine.async_engine import AsyncEngine, EngineFront
from services.engine.config import EngineConfig
from services.engine.core_client import EngineCoreClient
from services.engine.kv_transport import FakeTransport
from services.engine.kv_transport.fake import Faults
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from tests.grpc_server import loopback_server

TOKEN = bytes(range(16))
"""The reservation token every rig request carries."""


class RecordingReceiver:
    """Decode's side of the fake transport: keeps every chunk; ``gate`` (when set) holds each stream
    after its first chunk until opened."""

    def __init__(self) -> None:
        self.chunks: list[common_pb2.KVChunk] = []
        self.gate: asyncio.Event | None = None
        self.first_chunk = asyncio.Event()

    async def receive(self, chunks: AsyncIterator[common_pb2.KVChunk], on_claimed=None) -> decode_pb2.PushKVResponse:
        n = 0
        async for c in chunks:
            if c.HasField("claim") and on_claimed is not None:
                await on_claimed()
            self.chunks.append(c)
            n += 1
            self.first_chunk.set()
            if self.gate is not None:
                await self.gate.wait()
        return decode_pb2.PushKVResponse(chunks_received=n)


@dataclass
class PrefillRig:
    servicer: PrefillServicer
    stub: prefill_pb2_grpc.PrefillStub
    receiver: RecordingReceiver
    faults: Faults
    registry: CollectorRegistry
    address: str
    closers: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)

    @property
    def engine(self) -> EngineFront:
        return self.servicer.engine

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def idle(self, timeout_s: float = 10.0) -> dict[str, float]:
        """Engine stats once nothing runs or waits and every block is free (or the last seen)."""
        s: dict[str, float] = {}
        for _ in range(int(timeout_s / 0.05)):
            s = await self.engine.stats()
            if s["free_blocks"] == s["total_blocks"] and not (s["running"] + s["waiting"]):
                return s
            await asyncio.sleep(0.05)
        return s


def engine_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(**{"model": "random:tiny-llama", "dtype": "float32", "num_kv_blocks": 64,
                           "max_prefill_chunk": 7, **overrides})


def prefill_request(ids: list[int], **overrides: Any) -> prefill_pb2.PrefillRequest:
    fields: dict[str, Any] = dict(request_id="req", token_ids=ids, decode_address="decode-x", reservation_id="resv",
                                  reservation_token=TOKEN, params=common_pb2.SamplingParams(max_tokens=4, temperature=0))
    fields.update(overrides)
    return prefill_pb2.PrefillRequest(**fields)


async def start_prefill(config: PrefillConfig | None = None, engine: EngineConfig | None = None,
                        server_tls: TLSConfig | None = None, core: bool = False) -> PrefillRig:
    """``core``: the step loop in an engine-core process whose pool the servicer maps (engine_port.py)."""
    registry = CollectorRegistry()
    receiver = RecordingReceiver()
    faults = Faults()
    servicer = PrefillServicer(config or PrefillConfig(), PrefillMetrics(registry),
                               FakeTransport({"decode-x": receiver}, faults), asyncio.Event())
    ecfg = engine or engine_config()
    servicer.bind(await EngineCoreClient.start(ecfg, "prefill", role="prefill") if core
                  else await asyncio.to_thread(AsyncEngine, ecfg))
    server, address = await loopback_server(lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(servicer, s),
                                            server_tls)
    channel = create_channel(address, tls=server_tls)
    rig = PrefillRig(servicer, prefill_pb2_grpc.PrefillStub(channel), receiver, faults, registry, address)

    async def close() -> None:
        await channel.close()
        await server.stop(None)
        await servicer.close()
        await asyncio.to_thread(servicer.engine.shutdown)  # an engine core's STOP is written on this loop

    rig.closers.append(close)
    return rig


@pytest.fixture
async def make_prefill() -> AsyncIterator[Callable[..., Awaitable[PrefillRig]]]:
    rigs: list[PrefillRig] = []

    async def make(**kwargs: Any) -> PrefillRig:
        rig = await start_prefill(**kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        for close in rig.closers:
            await close()
