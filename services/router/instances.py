"""The router's view of prefill and decode instances: discovery, liveness, load, prefix index.

Targets are ``host:port`` or ``dns:NAME:PORT``; a DNS target (a Kubernetes headless Service) is
resolved to all its A records and refreshed, so pods that come and go are picked up.

Busy is not dead. Each instance has its own poll task (grpc.health.v1 Check, then
Admin.GetLoad) and one :class:`Liveness`:

- HEALTHY: its latest health answer said SERVING. Answers may be slow: a slow or timed-out answer
  inside the ``dead_after_s`` window changes nothing.
- SUSPECT: a dispatch call failed as if the peer were unreachable (UNAVAILABLE with no ErrorDetail).
  A connectivity probe starts at once and decides; until then it gets work only when no healthy
  instance is left.
- DEAD: connection refused (the channel is in TRANSIENT_FAILURE), health NOT_SERVING, the instance
  said it is going away (DRAINING / ENGINE_DEAD / LOADING), or no SERVING answer for ``dead_after_s``.
  It is taken back when health says SERVING again.
- UNKNOWN: not answered yet (just added); gets no work.

Overloaded (its LoadReport says ``saturated``, or it answered RESOURCE_EXHAUSTED within the last
retry-after) is not a liveness state: the instance is alive and skipped while others have room.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, common_pb2_grpc, decode_pb2_grpc, prefill_pb2_grpc
from services.common.tls import TLSConfig
from services.router.decode_stream import DecodeStreams

log = logging.getLogger(__name__)

PREFIX_INDEX_BLOCKS = 65536
"""Block hashes remembered per instance for prefix-aware routing (LRU)."""

PROBE_TIMEOUT_S = 2.0
"""Longest a connectivity probe of a suspect instance waits for its health answer (seconds); no
answer leaves it suspect, and the ``dead_after_s`` window decides."""

RECONNECT_BACKOFF_MS = (200, 2000)
"""gRPC reconnect backoff towards an instance (initial, max; milliseconds): a dead instance that
comes back is seen within a couple of seconds, not gRPC's default two minutes."""


class Liveness(enum.Enum):
    UNKNOWN = "unknown"
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEAD = "dead"


@dataclass(eq=False)
class Instance:
    address: str
    role: str
    channel: grpc.aio.Channel
    state: Liveness = Liveness.UNKNOWN
    why: str = "not checked yet"
    """What caused the latest state change (for logs and NoInstanceError messages)."""
    load: common_pb2.LoadReport | None = None
    inflight: int = 0
    """Requests this router has in flight there (reacts faster than the polled load)."""
    last_ok: float = field(default_factory=time.monotonic)
    """time.monotonic() of the latest SERVING answer (or of creation): the dead_after_s window's start."""
    overloaded_until: float = 0.0
    """time.monotonic() until which a RESOURCE_EXHAUSTED answer keeps this instance 'full'."""
    back_at: float = -math.inf
    """time.monotonic() of its latest return to HEALTHY from suspect or dead (a restart, typically)."""
    prefix: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    _streams: DecodeStreams | None = None

    @property
    def streams(self) -> DecodeStreams:
        """This router's token stream to the instance (a decode or colocated worker), made on first use."""
        if self._streams is None:
            self._streams = DecodeStreams(self.channel, self.address)
        return self._streams

    async def close(self) -> None:
        """End the token stream, then the channel."""
        if self._streams is not None:
            await self._streams.close()
        await self.channel.close()

    @property
    def decode(self) -> decode_pb2_grpc.DecodeStub:
        return decode_pb2_grpc.DecodeStub(self.channel)

    @property
    def prefill(self) -> prefill_pb2_grpc.PrefillStub:
        return prefill_pb2_grpc.PrefillStub(self.channel)

    @property
    def alive(self) -> bool:
        return self.state in (Liveness.HEALTHY, Liveness.SUSPECT)

    @property
    def healthy(self) -> bool:
        """Alive, as the instance_healthy gauge reports it (a suspect instance is not dead yet)."""
        return self.alive

    @property
    def overloaded(self) -> bool:
        saturated = self.load is not None and self.load.saturated
        return saturated or time.monotonic() < self.overloaded_until

    def load_score(self) -> float:
        """Queued and running requests (count) plus KV usage in [0, 1]."""
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


@dataclass(eq=False)
class InstancePool:
    """The instances of one role behind ``targets`` (host:port, or dns:NAME:PORT re-resolved every
    ``resolve_interval_s``), polled for health and load; ``on_health`` is told of each state change."""

    role: str
    targets: list[str]
    _: KW_ONLY
    health_interval_s: float = 1.0
    dead_after_s: float = 10.0
    resolve_interval_s: float = 10.0
    tls: TLSConfig | None = None
    on_health: Callable[[Instance], None] | None = None
    instances: dict[str, Instance] = field(default_factory=dict, init=False)
    _polls: dict[str, asyncio.Task] = field(default_factory=dict, init=False, repr=False)
    _tasks: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)
    _started: bool = field(default=False, init=False, repr=False)
    _rr: int = field(default=0, init=False, repr=False)
    _return_probe: asyncio.Task | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.dead_after_s <= 0 or self.health_interval_s <= 0:
            raise ValueError(f"health_interval_s ({self.health_interval_s}) and dead_after_s "
                             f"({self.dead_after_s}) must be > 0")

    @property
    def check_timeout_s(self) -> float:
        """Per-call timeout of a health poll or GetLoad (seconds): a timeout is one missed heartbeat."""
        return max(1.0, self.dead_after_s / 2)

    async def start(self) -> None:
        self._started = True
        await self._refresh_targets()
        for inst in self.instances.values():
            self._start_poll(inst)
        if any(t.startswith("dns:") for t in self.targets):
            self._spawn(self._resolve_loop())

    async def close(self) -> None:
        tasks = [*self._polls.values(), *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._polls.clear()
        for inst in self.instances.values():
            await inst.close()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_poll(self, inst: Instance) -> None:
        if inst.address not in self._polls:
            self._polls[inst.address] = asyncio.create_task(self._poll_loop(inst))

    def _channel(self, address: str) -> grpc.aio.Channel:
        lo, hi = RECONNECT_BACKOFF_MS
        return create_channel(address, tls=self.tls, options=[("grpc.initial_reconnect_backoff_ms", lo),
                                                              ("grpc.min_reconnect_backoff_ms", lo),
                                                              ("grpc.max_reconnect_backoff_ms", hi)])

    async def _refresh_targets(self) -> None:
        found: list[str] = []
        for t in self.targets:
            try:
                found += await asyncio.to_thread(_resolve, t)
            except OSError as e:
                log.warning("%s: cannot resolve %s: %s", self.role, t, e)
        for addr in found:
            if addr not in self.instances:
                inst = self.instances[addr] = Instance(addr, self.role, self._channel(addr))
                log.info("%s instance added: %s", self.role, addr)
                if self._started:
                    self._start_poll(inst)
        if any(t.startswith("dns:") for t in self.targets) and found:
            for addr in [a for a in self.instances if a not in found]:
                inst = self.instances.pop(addr)
                poll = self._polls.pop(addr, None)
                if poll is not None:
                    poll.cancel()
                    await asyncio.gather(poll, return_exceptions=True)
                await inst.close()
                log.info("%s instance removed (no longer in DNS): %s", self.role, addr)

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resolve_interval_s)
            await self._refresh_targets()

    async def _poll_loop(self, inst: Instance) -> None:
        while True:
            await self._check(inst, self.check_timeout_s)
            await asyncio.sleep(self.health_interval_s)

    async def _check(self, inst: Instance, timeout_s: float) -> None:
        """One heartbeat: health Check (decides liveness), then GetLoad (load only; its failure is not
        a missed heartbeat)."""
        try:
            resp = await health_pb2_grpc.HealthStub(inst.channel).Check(health_pb2.HealthCheckRequest(),
                                                                        timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            refused = (e.code() == grpc.StatusCode.UNAVAILABLE
                       and inst.channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE)
            if refused:
                self._set(inst, Liveness.DEAD, "connection refused")
            else:
                self._missed(inst, f"health check {e.code().name}")
            return
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            self._set(inst, Liveness.DEAD, f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
            return
        inst.last_ok = time.monotonic()
        self._set(inst, Liveness.HEALTHY, "health SERVING")
        try:
            inst.load = await common_pb2_grpc.AdminStub(inst.channel).GetLoad(common_pb2.GetLoadRequest(),
                                                                               timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("%s %s GetLoad failed (%s); keeping its last report", self.role, inst.address, e.code().name)

    def _missed(self, inst: Instance, why: str) -> None:
        silent_s = time.monotonic() - inst.last_ok
        if silent_s > self.dead_after_s:
            self._set(inst, Liveness.DEAD, f"no SERVING answer for {silent_s:.1f}s ({why})")

    def _set(self, inst: Instance, state: Liveness, why: str) -> None:
        if state == inst.state:
            return
        was, inst.state, inst.why = inst.state, state, why
        if state == Liveness.HEALTHY and was != Liveness.UNKNOWN:
            inst.back_at = time.monotonic()
        if state == Liveness.HEALTHY:
            log.log(logging.INFO if was == Liveness.UNKNOWN else logging.WARNING,
                    "%s %s is healthy%s", self.role, inst.address, "" if was == Liveness.UNKNOWN else " again")
        else:
            log.warning("%s %s is %s: %s", self.role, inst.address, state.value, why)
        if self.on_health is not None:
            self.on_health(inst)

    async def check_now(self) -> None:
        await asyncio.gather(*(self._check(i, self.check_timeout_s) for i in list(self.instances.values())))

    async def probe_for_return(self, exclude: set[str]) -> None:
        """Probe now every instance that is not alive, or is in ``exclude`` (it failed a request: it may
        have died and come back since), so a restarted one is HEALTHY at once instead of at the next
        poll. One round at a time per pool: concurrent callers share it."""
        if self._return_probe is None or self._return_probe.done():
            todo = [i for i in self.instances.values() if not i.alive or i.address in exclude]
            self._return_probe = self._spawn(self._probe_all(todo))
        await asyncio.shield(self._return_probe)

    async def _probe_all(self, todo: list[Instance]) -> None:
        await asyncio.gather(*(self._check(i, PROBE_TIMEOUT_S) for i in todo))

    # --- what dispatch saw ---

    def report_unreachable(self, inst: Instance, why: str) -> None:
        """A call failed as if the peer were gone: suspect until a connectivity probe decides."""
        if inst.state != Liveness.HEALTHY:
            return
        self._set(inst, Liveness.SUSPECT, why)
        self._spawn(self.probe(inst))

    def report_gone(self, inst: Instance, why: str) -> None:
        """The instance said it takes no more work (draining, engine dead, loading)."""
        self._set(inst, Liveness.DEAD, why)

    def report_overloaded(self, inst: Instance, retry_after_s: float) -> None:
        inst.overloaded_until = max(inst.overloaded_until, time.monotonic() + retry_after_s)

    async def probe(self, inst: Instance) -> bool:
        """A connectivity check now; True while the instance is alive."""
        await self._check(inst, PROBE_TIMEOUT_S)
        return inst.alive

    # --- selection ---

    def healthy(self, exclude: set[str] = frozenset()) -> list[Instance]:
        """Alive instances (healthy or suspect) not in ``exclude``."""
        return [i for i in self.instances.values() if i.alive and i.address not in exclude]

    def candidates(self, exclude: set[str] = frozenset()) -> list[Instance]:
        """Where new work should go: healthy instances with room; else every alive one (a full or
        suspect instance may still take it)."""
        alive = self.healthy(exclude)
        best = [i for i in alive if i.state == Liveness.HEALTHY and not i.overloaded]
        return best or alive

    def next_rr(self) -> int:
        self._rr += 1
        return self._rr


@contextlib.contextmanager
def inflight(inst: Instance) -> Iterator[Instance]:
    inst.inflight += 1
    try:
        yield inst
    finally:
        inst.inflight -= 1
