"""Router dispatch against fake decode/prefill servers at the gRPC boundary (tests/router/fake_peers.py):
merge of prefill's first token with decode's stream, retries, leases, aborts, migration."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from services.common.block_hash import block_hashes
from services.common.metrics import (
    ROUTER_DISPATCH_RETRIES_TOTAL,
    ROUTER_INSTANCE_WAITS_TOTAL,
    ROUTER_MIGRATIONS_TOTAL,
    RouterMetrics,
)
from services.common.pb import decode_pb2_grpc, prefill_pb2_grpc
from services.router.config import DECODE_STREAMS
from services.router.dispatch import DisaggregatedBackend, DispatchSettings
from services.router.instances import InstancePool, Liveness
from services.router.pipeline import BackendError, TokenEvent
from services.text.sampling_params import SamplingParams
from tests.router.fake_peers import BLOCK, FINGERPRINT, FakeCluster, reference, serve

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks


@dataclasses.dataclass
class Router:
    backend: DisaggregatedBackend
    registry: CollectorRegistry
    decode_pool: InstancePool
    prefill_pool: InstancePool | None

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def router(cluster: FakeCluster, *, colocated: bool = False, **settings) -> AsyncIterator[Router]:
    registry = CollectorRegistry()
    pool_args = dict(health_interval_s=0.2, dead_after_s=2.0)
    decode_pool = InstancePool("worker" if colocated else "decode",
                               [cluster.decode_addr(i) for i in range(len(cluster.decodes))], **pool_args)
    prefill_pool = None if colocated else InstancePool(
        "prefill", [cluster.prefill_addr(i) for i in range(len(cluster.prefills))], **pool_args)
    pools = [p for p in (decode_pool, prefill_pool) if p is not None]
    for p in pools:
        await p.start()
        await p.check_now()
        assert all(i.state == Liveness.HEALTHY for i in p.instances.values())
    backend = DisaggregatedBackend(prefill_pool, decode_pool, DispatchSettings(**{
                                       "policy": "prefix_aware", "decode_stream": cluster.decode_stream, **settings}),
                                   RouterMetrics(registry), "fake")
    try:
        yield Router(backend, registry, decode_pool, prefill_pool)
    finally:
        await backend.close()
        for p in pools:
            await p.close()


@pytest.fixture(params=DECODE_STREAMS)
async def cluster_factory(request):
    """Fake clusters, each test run with both ways tokens come back (--decode-stream)."""
    started: list[FakeCluster] = []

    async def make(n_decode: int, n_prefill: int) -> FakeCluster:
        c = await FakeCluster.start(n_decode, n_prefill)
        c.decode_stream = request.param
        started.append(c)
        return c

    yield make
    for c in started:
        await c.stop()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def collect(r: Router, n: int, prompt: list[int] = PROMPT, rid: str = "req-1",
                  deadline: float | None = None) -> list[TokenEvent]:
    out = []
    async for ev in r.backend.generate(rid, prompt, greedy(n), deadline=deadline):
        out.append(ev)
    return out


async def failure(r: Router, n: int, got: list[int] | None = None) -> BackendError:
    """The BackendError generating ``n`` tokens ends in (never a finish other than stop/length before it);
    the tokens streamed before it are appended to ``got``."""
    got = [] if got is None else got
    with pytest.raises(BackendError) as e:
        async for ev in r.backend.generate("req-1", PROMPT, greedy(n)):
            assert ev.finish_reason in (None, "stop", "length")
            got += ev.token_ids
    return e.value


async def exact(r: Router, n: int, **kw) -> list[TokenEvent]:
    """The events of generating ``n`` tokens, whose tokens must be the reference run's (no duplicate, no gap)."""
    events = await collect(r, n, **kw)
    assert tokens(events) == reference(PROMPT, n)
    return events


def tokens(events: list[TokenEvent]) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def prefer(pool: InstancePool, address: str, prompt: list[int] = PROMPT) -> None:
    """Make prefix_aware try ``address`` first (it 'holds' the prompt's prefix)."""
    pool.instances[address].remember(block_hashes(prompt, BLOCK))


async def eventually(cond, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


# --- merge, leases, deadlines ---

@pytest.mark.parametrize("reply_delay_s", [0.0, 0.3])
async def test_prefill_first_token_and_decode_stream_merge_without_dup_or_gap(cluster_factory, reply_delay_s):
    c = await cluster_factory(1, 1)
    c.prefill(0).reply_delay_s = reply_delay_s  # 0.3: decode's stream delivers the first token before prefill answers
    deadline = time.time() + 20
    async with router(c, lease_ms=30_000) as r:
        events = await collect(r, 8, deadline=deadline)
    assert tokens(events) == reference(PROMPT, 8)
    assert events[-1].finish_reason == "length" and all(ev.finish_reason is None for ev in events[:-1])
    assert all(ev.prompt_tokens == len(PROMPT) for ev in events)
    (reserve,) = c.decode(0).reserves
    (prefill,) = c.prefill(0).requests
    # Lease and deadline derive from the request's deadline; the reservation's secrets reach prefill.
    assert reserve.deadline_unix == pytest.approx(deadline) and prefill.deadline_unix == pytest.approx(deadline)
    assert 15_000 < reserve.lease_ms <= 20_000
    resv = c.decode(0).reservations[prefill.reservation_id]
    assert prefill.reservation_token == resv.token and prefill.expected_layout_fingerprint == FINGERPRINT
    assert list(prefill.accepted_wire_fingerprints) == ["fp-wire"] and list(prefill.dest_block_ids) == [1, 2, 3]
    assert list(prefill.token_ids) == PROMPT and prefill.decode_address == c.decode_addr(0)


async def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DispatchSettings().block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(("fault", "sent", "migrated"), [
    ("finish_abort_after", 2, False),  # decode's stream finishes ABORT: an error, not a short success
    ("die_after_tokens", 3, True),     # decode dies mid-stream and no other decode is left
])
async def test_a_decode_stream_cut_short_is_an_error_after_the_tokens_sent(cluster_factory, fault, sent, migrated):
    c = await cluster_factory(1, 1)
    setattr(c.decode(0), fault, sent)
    got: list[int] = []
    async with router(c, restart_wait_s=0.6) as r:  # the dead decode never comes back: give up soon
        assert (await failure(r, 10, got)).code == "unavailable"
        assert got == reference(PROMPT, sent)
        if migrated:
            assert r.metric(ROUTER_MIGRATIONS_TOTAL, outcome="failed") == 1


# --- prefill faults ---

async def test_prefill_death_retries_on_another_with_the_same_reservation_and_renews_lease(cluster_factory):
    c = await cluster_factory(1, 2)
    c.prefill(0).die_after_s = 0.5  # dies mid-call ("mid-transfer")
    c.prefill(1).compute_s = 0.4
    async with router(c, lease_ms=300) as r:  # renewed every 100 ms while Prefill is in flight
        prefer(r.prefill_pool, c.prefill_addr(0))
        await exact(r, 6)
        assert r.metric(ROUTER_DISPATCH_RETRIES_TOTAL, role="prefill", reason="unavailable") == 1
        assert r.prefill_pool.instances[c.prefill_addr(0)].state == Liveness.DEAD  # connectivity probe: refused
    (first,), (second,) = c.prefill(0).requests, c.prefill(1).requests
    assert len(c.decode(0).reserves) == 1
    assert second.reservation_id == first.reservation_id and second.reservation_token == first.reservation_token
    renewed = [x for x in c.decode(0).renewals if x.reservation_id == first.reservation_id]
    assert len(renewed) >= 4  # ~0.9 s of prefill at one renewal per 100 ms
    assert all(x.reservation_token == first.reservation_token and 0 < x.lease_ms <= 300 for x in renewed)


async def test_no_prefill_left_fails_unavailable_and_aborts_the_reservation(cluster_factory):
    c = await cluster_factory(1, 1)
    c.prefill(0).die_after_s = 0.2
    async with router(c, lease_ms=300, restart_wait_s=0.6) as r:  # it never comes back
        assert (await failure(r, 6)).code == "unavailable"
        assert r.metric(ROUTER_INSTANCE_WAITS_TOTAL, role="prefill", outcome="gave_up") == 1
        rid = c.decode(0).reserves and next(iter(c.prefill(0).requests)).reservation_id
        await eventually(lambda: rid in c.decode(0).aborts)
        assert rid not in c.decode(0).reservations  # freed


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_the_only_instance_restarting_is_waited_for_within_the_deadline(cluster_factory, role):
    """The only prefill dies mid-call (or the only decode is dead at Reserve) and comes back on the same
    address 1 s later, as a supervisor restarts it: the request waits, completes with the exact tokens,
    and the wait is counted."""
    c = await cluster_factory(1, 1)
    async with router(c, lease_ms=600, restart_wait_s=20.0) as r:
        if role == "prefill":
            c.prefill(0).die_after_s = 0.2
            peer_of = c.prefills
        else:
            await c.decodes[0][0].die()
            await eventually(lambda: r.decode_pool.instances[c.decode_addr(0)].state == Liveness.DEAD)
            peer_of = c.decodes
        task = asyncio.create_task(collect(r, 6, deadline=time.time() + 30))
        old_peer, servicer = peer_of[0]
        if role == "prefill":
            await eventually(lambda: old_peer.dead)
        await asyncio.sleep(1.0)
        if role == "prefill":
            servicer.die_after_s = None
        port = int(old_peer.address.rsplit(":", 1)[1])
        adder = (prefill_pb2_grpc.add_PrefillServicer_to_server if role == "prefill"
                 else decode_pb2_grpc.add_DecodeServicer_to_server)
        new_peer = await serve([(adder, servicer)], port=port)
        servicer.peer = new_peer
        peer_of[0] = (new_peer, servicer)
        assert tokens(await asyncio.wait_for(task, 25)) == reference(PROMPT, 6)
        assert r.metric(ROUTER_INSTANCE_WAITS_TOTAL, role=role, outcome="back") >= 1


async def test_prefill_overloaded_everywhere_is_resource_exhausted_with_retry_after(cluster_factory):
    c = await cluster_factory(1, 2)
    for i in range(2):
        c.prefill(i).full_retry_after_ms = 1500
    async with router(c) as r:
        err = await failure(r, 4)
        assert err.code == "resource_exhausted" and err.retry_after_s == pytest.approx(1.5)
        await eventually(lambda: len(c.decode(0).aborts) == 1)


async def test_handoff_failure_with_a_live_decode_fails_without_retrying_prefill(cluster_factory):
    c = await cluster_factory(1, 2)
    c.prefill(0).handoff_fails = c.prefill(1).handoff_fails = True
    async with router(c) as r:
        assert (await failure(r, 4)).code == "unavailable"
    assert len(c.prefill(0).requests) + len(c.prefill(1).requests) == 1


# --- reserve faults ---

async def test_reserve_overloaded_moves_to_the_next_decode(cluster_factory):
    c = await cluster_factory(2, 1)
    c.decode(0).full_retry_after_ms = 2000
    async with router(c) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        await exact(r, 5)
        assert len(c.decode(0).reserves) == 1 and len(c.decode(1).reserves) == 1
        # The first try had another decode left: no wait for blocks there; the last one may wait.
        assert c.decode(0).reserves[0].block_wait_ms == 0
        assert 0 < c.decode(1).reserves[0].block_wait_ms <= r.backend.s.block_wait_s * 1000
        assert r.metric(ROUTER_DISPATCH_RETRIES_TOTAL, role="decode", reason="overloaded") == 1
        full = r.decode_pool.instances[c.decode_addr(0)]
        assert full.alive and full.overloaded  # alive, skipped while another has room
        await collect(r, 3, rid="req-2")
        assert len(c.decode(0).reserves) == 1 and len(c.decode(1).reserves) == 2


async def test_all_decodes_overloaded_is_resource_exhausted_with_retry_after(cluster_factory):
    c = await cluster_factory(2, 1)
    c.decode(0).full_retry_after_ms = c.decode(1).full_retry_after_ms = 700
    async with router(c, early_prefill=False) as r:  # early: tests/router/test_early_prefill.py
        err = await failure(r, 4)
    assert err.code == "resource_exhausted" and err.retry_after_s == pytest.approx(0.7)
    assert len(c.decode(0).reserves) == 1 and len(c.decode(1).reserves) == 1
    assert not c.prefill(0).requests


async def test_unreachable_decode_is_skipped_at_reserve(cluster_factory):
    c = await cluster_factory(2, 1)
    async with router(c) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        await c.decodes[0][0].die()
        await exact(r, 4)
        assert r.metric(ROUTER_DISPATCH_RETRIES_TOTAL, role="decode", reason="unavailable") == 1
        await eventually(lambda: r.decode_pool.instances[c.decode_addr(0)].state == Liveness.DEAD)


# --- migration ---

async def test_decode_death_mid_stream_migrates_with_the_exact_tokens(cluster_factory):
    c = await cluster_factory(2, 1)
    c.decode(0).die_after_tokens = 3
    async with router(c) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        events = await exact(r, 10)  # no duplicate, no gap
        assert events[-1].finish_reason == "length"
        assert r.metric(ROUTER_MIGRATIONS_TOTAL, outcome="ok") == 1
    (moved,) = c.decode(1).reserves
    assert list(moved.token_ids) == PROMPT + reference(PROMPT, 3)
    assert moved.params.max_tokens == 7
    assert list(c.prefill(0).requests[-1].token_ids) == PROMPT + reference(PROMPT, 3)


@contextlib.asynccontextmanager
async def colocated_first_faulty(cluster_factory, **fault: int) -> AsyncIterator[tuple[FakeCluster, Router]]:
    """Two colocated workers, ``fault`` (FakeDecode fields) set on worker 0, which the router prefers."""
    c = await cluster_factory(2, 0)
    for name, value in fault.items():
        setattr(c.decode(0), name, value)
    async with router(c, colocated=True) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        yield c, r


async def test_colocated_worker_death_mid_stream_migrates(cluster_factory):
    async with colocated_first_faulty(cluster_factory, die_after_tokens=4) as (c, r):
        await exact(r, 9)
        assert r.metric(ROUTER_MIGRATIONS_TOTAL, outcome="ok") == 1
    (moved,) = c.decode(1).colocated
    assert list(moved.token_ids) == PROMPT + reference(PROMPT, 4) and moved.params.max_tokens == 5


async def test_colocated_full_worker_is_skipped(cluster_factory):
    async with colocated_first_faulty(cluster_factory, full_retry_after_ms=500) as (_, r):
        await exact(r, 4)
        assert r.metric(ROUTER_DISPATCH_RETRIES_TOTAL, role="worker", reason="overloaded") == 1


# --- cancel ---

async def test_client_cancel_aborts_the_reservation(cluster_factory):
    c = await cluster_factory(1, 1)
    c.decode(0).token_delay_s = 0.05
    async with router(c) as r:
        gen = r.backend.generate("req-1", PROMPT, greedy(50))
        got = []
        async for ev in gen:
            got += ev.token_ids
            if len(got) >= 3:
                break
        await gen.aclose()
        (rid,) = c.decode(0).reservations
        await eventually(lambda: rid in c.decode(0).aborts)
        assert r.backend.active == {}


async def test_backend_abort_reaches_the_decode_holding_the_request(cluster_factory):
    c = await cluster_factory(1, 1)
    c.decode(0).token_delay_s = 0.05
    async with router(c) as r:
        gen = r.backend.generate("req-7", PROMPT, greedy(50))
        await anext(gen)
        (rid,) = c.decode(0).reservations
        await r.backend.abort("req-7")
        assert rid in c.decode(0).aborts
        await gen.aclose()


async def test_decode_death_before_the_first_token_redispatches(cluster_factory):
    c = await cluster_factory(2, 1)
    c.prefill(0).compute_s = 0.5
    async with router(c) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        task = asyncio.create_task(collect(r, 6))
        await eventually(lambda: len(c.decode(0).reserves) == 1)
        await c.decodes[0][0].die()
        assert tokens(await task) == reference(PROMPT, 6)
        assert r.metric(ROUTER_DISPATCH_RETRIES_TOTAL, role="decode", reason="lost") == 1
        assert r.metric(ROUTER_MIGRATIONS_TOTAL, outcome="ok") == 0  # nothing was sent yet: not a migration
    assert len(c.decode(1).reserves) == 1
