"""Liveness of instances as the router sees them: busy is not dead (real grpc.aio health servers)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import pytest
from grpc_health.v1 import health_pb2

from services.router.instances import Instance, InstancePool, Liveness
from tests.router.fake_peers import Peer, serve


async def _until(cond, within_s: float) -> float:
    """Seconds until cond() held; fails after ``within_s`` seconds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within_s, "condition not met in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
async def peer():
    p = await serve([])
    yield p
    await p.die()


@contextlib.asynccontextmanager
async def _watched(address: str, *, healthy: bool = True, **kw) -> AsyncIterator[tuple[InstancePool, Instance]]:
    """A decode pool probing ``address`` every 0.2 s (``pool.changes``: each state change, in order) and its
    instance, once HEALTHY when ``healthy``; the pool is closed on exit."""
    changes: list[tuple[str, Liveness]] = []
    pool = InstancePool("decode", [address], health_interval_s=0.2, on_health=lambda i: changes.append(
        (i.address, i.state)), **kw)
    pool.changes = changes  # type: ignore[attr-defined]
    await pool.start()
    try:
        inst = pool.instances[address]
        if healthy:
            await _until(lambda: inst.state == Liveness.HEALTHY, 5)
        yield pool, inst
    finally:
        await pool.close()


async def test_slow_health_answers_keep_an_instance_alive(peer: Peer):
    async with _watched(peer.address, dead_after_s=10.0) as (pool, inst):
        peer.health.delay_s = 3.0  # a busy host: every answer takes 3 s (inside the 5 s per-call timeout)
        checks = peer.health.checks
        await _until(lambda: peer.health.checks >= checks + 3, 15)
        await asyncio.sleep(3.5)
        assert inst.state == Liveness.HEALTHY
        assert pool.changes == [(peer.address, Liveness.HEALTHY)]  # type: ignore[attr-defined]


async def test_timeouts_inside_the_window_keep_it_alive_then_it_is_dead(peer: Peer):
    async with _watched(peer.address, dead_after_s=3.0) as (_, inst):  # per-call timeout 1.5 s
        peer.health.delay_s = 60.0  # hung: no answer at all
        silent_from = time.monotonic()
        await _until(lambda: peer.health.checks >= 3, 10)
        assert inst.state == Liveness.HEALTHY or time.monotonic() - silent_from > 3.0
        await _until(lambda: inst.state == Liveness.DEAD, 10)
        assert time.monotonic() - silent_from >= 3.0
        assert "no SERVING answer" in inst.why


async def test_refused_connection_is_dead_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket closes
    async with _watched(f"127.0.0.1:{port}", healthy=False, dead_after_s=30.0) as (_, inst):
        assert await _until(lambda: inst.state == Liveness.DEAD, 5) < 5
        assert inst.why == "connection refused"


async def test_killed_instance_is_dead_quickly_and_taken_back_when_it_serves_again():
    peer = await serve([])
    async with _watched(peer.address, dead_after_s=30.0) as (_, inst):
        await peer.die()
        assert await _until(lambda: inst.state == Liveness.DEAD, 5) < 5  # well inside the 30 s window
        port = int(peer.address.rsplit(":", 1)[1])
        again = None
        for _ in range(50):  # the port may take a moment to be free again
            try:
                again = await serve([], port=port)
                break
            except RuntimeError:
                await asyncio.sleep(0.1)
        assert again is not None
        try:
            await _until(lambda: inst.state == Liveness.HEALTHY, 10)
        finally:
            await again.die()


async def test_not_serving_is_dead_and_serving_again_is_healthy(peer: Peer):
    async with _watched(peer.address, dead_after_s=30.0) as (pool, inst):
        peer.health.status = health_pb2.HealthCheckResponse.NOT_SERVING
        await _until(lambda: inst.state == Liveness.DEAD, 5)
        assert inst.why == "health NOT_SERVING"
        assert pool.healthy() == []
        peer.health.status = health_pb2.HealthCheckResponse.SERVING
        await _until(lambda: inst.state == Liveness.HEALTHY, 5)
        assert pool.changes == [(peer.address, s) for s in  # type: ignore[attr-defined]
                                (Liveness.HEALTHY, Liveness.DEAD, Liveness.HEALTHY)]  # each change once


async def test_unreachable_report_makes_it_suspect_until_a_probe_decides(peer: Peer):
    async with _watched(peer.address, dead_after_s=30.0) as (pool, inst):
        peer.health.delay_s = 0.5
        pool.report_unreachable(inst, "Generate UNAVAILABLE")
        assert inst.state == Liveness.SUSPECT and inst.alive
        await _until(lambda: inst.state == Liveness.HEALTHY, 5)  # the probe got SERVING: it was a blip
        await peer.die()
        pool.report_unreachable(inst, "Generate UNAVAILABLE")
        await _until(lambda: inst.state == Liveness.DEAD, 5)


async def test_saturated_load_report_is_alive_but_overloaded(peer: Peer):
    peer.admin.load.saturated = True
    async with _watched(peer.address, healthy=False) as (pool, inst):
        await _until(lambda: inst.load is not None, 5)
        assert inst.alive and inst.overloaded
        assert pool.candidates() == [inst]  # nothing else: a full instance may still take work
