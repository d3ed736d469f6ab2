"""The router's handoff phase histogram (pdserve_router_handoff_phase_seconds): every point of one P/D request
observed once, in order, whichever side delivers the first token, and once per request when a migration runs a
second attempt; Prefill carries the time it was sent. Order only: no timing slack (the box may be loaded)."""

from __future__ import annotations

import time

import pytest

from tests.router.test_router_dispatch import (
    PROMPT,
    cluster_factory,  # noqa: F401 (the fixture)
    collect,
    exact,
    prefer,
    reference,
    router,
    tokens,
)

PHASE = "pdserve_router_handoff_phase_seconds"
POINTS = ("reserve", "prefill_sent", "prefill_response", "decode_first", "first_token")


@pytest.mark.parametrize("reply_delay_s", [0.0, 0.3])  # 0.3: decode's stream delivers the first token first
async def test_each_handoff_point_is_observed_once_in_order(cluster_factory, reply_delay_s) -> None:  # noqa: F811
    c = await cluster_factory(1, 1)
    c.prefill(0).reply_delay_s = reply_delay_s
    t0 = time.time()
    async with router(c, lease_ms=30_000, early_prefill=False) as r:  # early: tests/router/test_early_prefill.py
        events = await collect(r, 4)
        took = time.time() - t0
        count = {p: r.registry.get_sample_value(f"{PHASE}_count", {"phase": p}) for p in POINTS}
        at = {p: r.registry.get_sample_value(f"{PHASE}_sum", {"phase": p}) for p in POINTS}
    assert tokens(events) == reference(PROMPT, 4)
    assert count == dict.fromkeys(POINTS, 1.0)
    assert 0 <= at["reserve"] <= at["prefill_sent"] <= min(at["prefill_response"], at["decode_first"]) < took
    assert at["first_token"] >= min(at["prefill_response"], at["decode_first"])
    if reply_delay_s:
        assert at["prefill_response"] >= at["decode_first"]
    (prefill,) = c.prefill(0).requests
    assert t0 <= prefill.sent_unix <= t0 + took


async def test_a_migration_observes_each_point_once_and_first_token_is_the_clients(cluster_factory) -> None:  # noqa: F811
    c = await cluster_factory(2, 1)
    c.decode(0).die_after_tokens = 3  # the second attempt (decode 1) reserves, prefills and streams again
    async with router(c, early_prefill=False) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        t0 = time.monotonic()
        await exact(r, 10)
        took = time.monotonic() - t0
        count = {p: r.registry.get_sample_value(f"{PHASE}_count", {"phase": p}) for p in POINTS}
        at = {p: r.registry.get_sample_value(f"{PHASE}_sum", {"phase": p}) for p in POINTS}
    assert len(c.decode(1).reserves) == 1 and len(c.prefill(0).requests) == 2  # two attempts ran
    assert count == dict.fromkeys(POINTS, 1.0)
    assert 0 <= at["reserve"] <= at["prefill_sent"] <= at["first_token"] < took
