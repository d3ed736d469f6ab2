"""The router's view of prefill and decode instances: discovery, health, load, prefix index.

Targets are ``host:port`` or ``dns:NAME:PORT``; a DNS target (a Kubernetes headless Service) is
resolved to all its A records and refreshed, so pods that come and go are picked up. An instance
that fails a call is marked unhealthy at once and taken back when its health check says SERVING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc

log = logging.getLogger(__name__)

PREFIX_INDEX_BLOCKS = 65536
"""Block hashes remembered per instance for prefix-aware routing (LRU)."""


@dataclass(eq=False)
class Instance:
    address: str
    role: str
    channel: grpc.aio.Channel
    healthy: bool = True
    load: common_pb2.LoadReport | None = None
    inflight: int = 0
    """Requests this router has in flight there (reacts faster than the polled load)."""
    failures: int = 0
    last_seen: float = field(default_factory=time.monotonic)
    prefix: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    @property
    def decode(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel)

    @property
    def prefill(self) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self.channel)

    def load_score(self) -> float:
        rep = self.load
        polled = (rep.running + rep.waiting + rep.waiting_for_kv) if rep is not None else 0
        usage = rep.kv_usage if rep is not None else 0.0
        return max(polled, self.inflight) + usage

    def prefix_match(self, hashes: list[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.prefix:
                break
            n += 1
        return n

    def remember(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self.prefix[h] = None
            self.prefix.move_to_end(h)
        while len(self.prefix) > PREFIX_INDEX_BLOCKS:
            self.prefix.popitem(last=False)


def _resolve(target: str) -> list[str]:
    if not target.startswith("dns:"):
        return [target]
    name, _, port = target[4:].rpartition(":")
    infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    return sorted({f"{i[4][0]}:{port}" if ":" not in i[4][0] else f"[{i[4][0]}]:{port}" for i in infos})


class InstancePool:
    def __init__(self, role: str, targets: list[str], *, health_interval_s: float = 1.0,
                 resolve_interval_s: float = 10.0, on_health=None) -> None:
        self.role = role
        self.targets = targets
        self.health_interval_s = health_interval_s
        self.resolve_interval_s = resolve_interval_s
        self.instances: dict[str, Instance] = {}
        self._on_health = on_health
        self._tasks: list[asyncio.Task] = []
        self._rr = 0

    async def start(self) -> None:
        await self._refresh_targets()
        self._tasks = [asyncio.create_task(self._health_loop()), asyncio.create_task(self._resolve_loop())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for inst in self.instances.values():
            await inst.channel.close()

    async def _refresh_targets(self) -> None:
        found: list[str] = []
        for t in self.targets:
            try:
                found += await asyncio.to_thread(_resolve, t)
            except OSError as e:
                log.warning("%s: cannot resolve %s: %s", self.role, t, e)
        for addr in found:
            if addr not in self.instances:
                self.instances[addr] = Instance(addr, self.role, create_channel(addr))
                log.info("%s instance added: %s", self.role, addr)
        if any(t.startswith("dns:") for t in self.targets) and found:
            for addr in [a for a in self.instances if a not in found]:
                inst = self.instances.pop(addr)
                await inst.channel.close()
                log.info("%s instance removed (no longer in DNS): %s", self.role, addr)

    async def _resolve_loop(self) -> None:
        if not any(t.startswith("dns:") for t in self.targets):
            return
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._refresh_targets()

    async def _check(self, inst: Instance) -> None:
        try:
            resp = await health_pb2_grpc.HealthStub(inst.channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=max(0.5, self.health_interval_s))
            ok = resp.status == health_pb2.HealthCheckResponse.SERVING
            if ok:
                inst.load = await common_pb2_grpc.AdminStub(inst.channel).GetLoad(common_pb2.GetLoadRequest(),
                                                                                   timeout=1.0)
        except grpc.aio.AioRpcError:
            ok = False
        if ok != inst.healthy:
            log.warning("%s %s is %s", self.role, inst.address, "healthy again" if ok else "unhealthy")
        inst.healthy = ok
        if ok:
            inst.failures = 0
            inst.last_seen = time.monotonic()
        if self._on_health is not None:
            self._on_health(inst)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(i) for i in list(self.instances.values())))
            await asyncio.sleep(self.health_interval_s)

    async def check_now(self) -> None:
        await asyncio.gather(*(self._check(i) for i in list(self.instances.values())))

    def mark_failed(self, inst: Instance, why: str) -> None:
        inst.failures += 1
        if inst.healthy:
            log.warning("%s %s marked unhealthy: %s", self.role, inst.address, why)
        inst.healthy = False
        if self._on_health is not None:
            self._on_health(inst)

    def healthy(self, exclude: set[str] = frozenset()) -> list[Instance]:
        return [i for i in self.instances.values() if i.healthy and i.address not in exclude]

    def next_rr(self) -> int:
        self._rr += 1
        return self._rr


@contextlib.contextmanager
def inflight(inst: Instance):
    inst.inflight += 1
    try:
        yield inst
    finally:
        inst.inflight -= 1
