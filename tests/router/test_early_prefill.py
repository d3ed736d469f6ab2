"""Early prefill at the router, against fake peers at the gRPC boundary: Prefill goes out before
Reserve answered and without a reservation, AttachReservation hands it over (naming the decode that
finally reserved, when Reserve was retried on another); every decode full cancels the early Prefill and
the client gets the same 429-style answer as without it; while decode answered OVERLOADED in the last
second, no Prefill goes out early."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common import grpc_util
from services.common.grpc_util import Reason, error_detail
from tests.router.fake_peers import FakePrefill
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
    # times since the request began: Prefill went out before Reserve answered, the attach after it. The
    # first token comes after Reserve too; it may land before AttachReservation's answer is read (two calls).
    assert at["prefill_sent"] < at["reserve"] <= at["attached"], at
    assert at["reserve"] <= at["first_token"], at
    assert at["reserve"] >= 0.2, at
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
        err = await failure(r, 4)  # at once, within a second of OVERLOADED: Reserve first, so no Prefill at all
        assert err.code == "resource_exhausted"
        assert r.metric(f"{PHASE}_count", phase="prefill_sent") == 1
        await eventually(lambda: c.prefill(0).early_cancelled == 1)
    assert len(c.prefill(0).requests) == 1  # the first, sent early, then cancelled


def _early_call_ends_before_its_attach(monkeypatch: pytest.MonkeyPatch, code: grpc.StatusCode,
                                       retryable: bool) -> None:
    """Every fake prefill's early call ends with ``code`` once its attach came, and the attach is refused as a
    real prefill refuses one whose call ended (FAILED_PRECONDITION on attach_id), before the call's own status
    reaches the router. A Prefill carrying its reservation (a retry) is served as usual."""
    ended: dict[str, asyncio.Event] = {}
    serve = FakePrefill.Prefill

    async def attach(self, request, context):
        ended.setdefault(request.attach_id, asyncio.Event()).set()
        await grpc_util.abort(context, grpc.StatusCode.FAILED_PRECONDITION, "the Prefill call ended before it "
                              "took the reservation", error_detail(Reason.ERROR_REASON_INVALID_INPUT,
                                                                   side="prefill", field="attach_id"))

    async def prefill(self, request, context):
        if not request.attach_id:
            return await serve(self, request, context)
        self.requests.append(request)
        await ended.setdefault(request.attach_id, asyncio.Event()).wait()
        await asyncio.sleep(0.2)  # the attach's refusal reaches the router first
        await grpc_util.abort(context, code, "prefill failed", error_detail(Reason.ERROR_REASON_UNSPECIFIED,
                                                                            retryable=retryable, side="prefill"))

    monkeypatch.setattr(FakePrefill, "AttachReservation", attach)
    monkeypatch.setattr(FakePrefill, "Prefill", prefill)


async def test_an_attach_refused_as_its_call_ended_leaves_the_calls_own_status(
        cluster_factory, monkeypatch) -> None:  # noqa: F811
    _early_call_ends_before_its_attach(monkeypatch, grpc.StatusCode.INTERNAL, retryable=False)
    c = await cluster_factory(1, 1)
    async with router(c) as r:
        err = await failure(r, 4)
    assert err.code == "internal", err  # the call's own failure, not a 400 about attach_id


async def test_an_attach_refused_as_its_call_ended_retries_a_retryable_call(
        cluster_factory, monkeypatch) -> None:  # noqa: F811
    _early_call_ends_before_its_attach(monkeypatch, grpc.StatusCode.UNAVAILABLE, retryable=True)
    c = await cluster_factory(1, 2)
    async with router(c) as r:
        await exact(r, 4)
    retried, early = sorted((p for i in range(2) for p in c.prefill(i).requests), key=lambda p: bool(p.attach_id))
    assert early.attach_id and not retried.attach_id and retried.decode_address == c.decode_addr(0)


async def test_a_reserve_waiting_for_blocks_turns_early_prefill_off_until_one_answers_at_once(
        cluster_factory) -> None:  # noqa: F811
    """A decode whose Reserves wait for free KV blocks (its queue moving, not refusing): while one has waited a
    second, and for a second after such a wait answered, requests reserve first, so no prompt is computed
    early to sit in prefill's pool waiting for its turn at decode; once Reserves answer at once, early is on."""
    c = await cluster_factory(1, 1)
    c.decode(0).reserve_delay_s = 1.6  # the last decode left: its Reserves carry block_wait_ms
    async with router(c) as r:
        slow = asyncio.ensure_future(collect(r, 4, rid="slow"))
        await asyncio.sleep(1.2)  # the slow Reserve has waited past DECODE_FULL_MEMORY_S
        c.decode(0).reserve_delay_s = 0.0
        assert tokens(await collect(r, 4, rid="behind")) == reference(PROMPT, 4)
        assert c.prefill(0).requests[-1].attach_id == ""  # reserved first: sent with its reservation
        assert tokens(await slow) == reference(PROMPT, 4)  # early, attached after its long Reserve
        assert c.decode(0).reserves[0].block_wait_ms > 0
        await collect(r, 4, rid="right-after")  # within a second of the slow Reserve's answer: still reserve first
        assert c.prefill(0).requests[-1].attach_id == ""
        await asyncio.sleep(1.1)
        await collect(r, 4, rid="later")  # the last Reserve answered at once, a second ago: early again
        assert c.prefill(0).requests[-1].attach_id != ""
    assert r.metric(f"{PHASE}_count", phase="prefill_sent") == 4
