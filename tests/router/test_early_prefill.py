"""Early prefill at the router (issue 10), against fake peers at the gRPC boundary: Prefill goes out before
Reserve answered and without a reservation, AttachReservation hands it over (naming the decode that
finally reserved, when Reserve was retried on another); every decode full cancels the early Prefill and
the client gets the same 429-style answer as without it; while decode answered OVERLOADED in the last
second, no Prefill goes out early."""

from __future__ import annotations

import pytest

from tests.router.test_router_dispatch import (
    PROMPT,
    cluster_factory,  # noqa: F401 (the fixture)
    collect,
    eventually,
    exact,
    failure,
    prefer,
    reference,
    router,
    tokens,
)

PHASE = "pdserve_router_handoff_phase_seconds"


async def test_prefill_is_sent_before_reserve_answers_and_attached_after(cluster_factory) -> None:  # noqa: F811
    c = await cluster_factory(1, 1)
    c.decode(0).reserve_delay_s = 0.2
    async with router(c, lease_ms=30_000) as r:
        events = await collect(r, 4)
        at = {p: r.registry.get_sample_value(f"{PHASE}_sum", {"phase": p})
              for p in ("prefill_sent", "reserve", "attached", "first_token")}
    assert tokens(events) == reference(PROMPT, 4)
    assert at["prefill_sent"] < 0.2 <= at["reserve"] <= at["attached"] <= at["first_token"], at
    (prefill,) = c.prefill(0).requests  # as it ended up: the early call with the attached reservation
    (attach_id,) = c.prefill(0).attaches
    assert prefill.attach_id == attach_id and prefill.decode_address == c.decode_addr(0)
    assert prefill.reservation_token.startswith(b"token-")


async def test_a_reserve_retried_on_another_decode_attaches_that_one(cluster_factory) -> None:  # noqa: F811
    c = await cluster_factory(2, 1)
    c.decode(0).full_retry_after_ms = 700
    async with router(c) as r:
        prefer(r.decode_pool, c.decode_addr(0))
        await exact(r, 6)
    assert len(c.decode(0).reserves) == 1 and len(c.decode(1).reserves) == 1
    (prefill,) = c.prefill(0).requests
    assert prefill.attach_id and prefill.decode_address == c.decode_addr(1)


async def test_every_decode_full_cancels_the_early_prefill_and_turns_early_off(cluster_factory) -> None:  # noqa: F811
    c = await cluster_factory(2, 1)
    c.decode(0).full_retry_after_ms = c.decode(1).full_retry_after_ms = 700
    async with router(c) as r:
        err = await failure(r, 4)
        assert err.code == "resource_exhausted" and err.retry_after_s == pytest.approx(0.7)
        await eventually(lambda: c.prefill(0).early_cancelled == 1)
        assert len(c.prefill(0).requests) == 1  # sent early, then cancelled
        err = await failure(r, 4)  # within a second of OVERLOADED: Reserve first, so no Prefill at all
        assert err.code == "resource_exhausted"
    assert len(c.prefill(0).requests) == 1
