"""Early Prefill: a Prefill sent before decode's Reserve answered computes at once and gets its
reservation with AttachReservation. Real prefill and decode servicers (tests/prefill/test_transports.py's
pair): the tokens equal the engine's on every CPU transport whether the attach comes at once or after the
prompt was computed, with decode prefix hits (num_skip_blocks); a bad, duplicate, unknown or foreign attach
is refused with a clear status and changes nothing (under mTLS only the router may attach); no attach within --claim-wait-s and a cancelled call
free every block; a claim decode refuses stops the request before its last chunk."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import grpc
import pytest

from services.common.grpc_util import Reason, create_channel, detail_of
from services.common.pb import decode_pb2, prefill_pb2, prefill_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.prefill.attach import AttachRefused, Offer, merged
from services.prefill.config import PrefillConfig
from tests.prefill.conftest import TOKEN, prefill_request
from tests.prefill.test_claim_overlap import HANG_GUARD, _computed, _prompt_done, _want
from tests.prefill.test_transports import (  # noqa: F401 (pair: the fixture)
    PROMPTS,
    TRANSPORTS,
    Pair,
    _assert_freed,
    _generate,
    _request,
    _reserve,
    _until,
    pair,
)

ATTACH_ID = "a-1"


def _early(p: Pair, ids: list[int], attach_id: str = ATTACH_ID) -> prefill_pb2.PrefillRequest:
    """The Prefill the router sends before Reserve answered: _request's call without its reservation."""
    full = _request(p, decode_pb2.ReserveResponse(), ids)
    req = prefill_pb2.PrefillRequest(request_id=full.request_id, token_ids=full.token_ids, params=full.params,
                                     attach_id=attach_id)
    return req


def _attach(p: Pair, resv: decode_pb2.ReserveResponse, ids: list[int], attach_id: str = ATTACH_ID
            ) -> prefill_pb2.AttachReservationRequest:
    full = _request(p, resv, ids)
    msg = prefill_pb2.AttachReservationRequest(
        request_id=full.request_id, attach_id=attach_id, decode_address=full.decode_address,
        reservation_id=full.reservation_id, num_skip_blocks=full.num_skip_blocks,
        expected_layout_fingerprint=full.expected_layout_fingerprint, dest_block_ids=full.dest_block_ids,
        reservation_token=full.reservation_token, accepted_wire_fingerprints=full.accepted_wire_fingerprints)
    msg.destination.CopyFrom(full.destination)
    return msg


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value


async def _run_early(p: Pair, ids: list[int], *, late: bool, attach_id: str = ATTACH_ID) -> decode_pb2.ReserveResponse:
    """One early request end to end; returns its reservation (the tokens are checked here)."""
    call = asyncio.ensure_future(p.pstub.Prefill(_early(p, ids, attach_id)))
    if late:  # the whole prompt computed before the reservation is known: its blocks are held meanwhile
        await _until(lambda: _prompt_done(p), HANG_GUARD)
        assert _prompt_done(p)
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.AttachReservation(_attach(p, resv, ids, attach_id))
    resp = await call
    assert resp.num_prompt_tokens == len(ids)
    assert await consume == _want(ids)
    return resv


@pytest.mark.parametrize("late", [False, True], ids=["attach-at-once", "attach-after-compute"])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_an_early_prefill_gives_the_engines_tokens(pair, transport: str, late: bool) -> None:  # noqa: F811
    p = await pair(transport)
    ids = PROMPTS[1]
    await _run_early(p, ids, late=late)
    again = await _run_early(p, ids, late=late, attach_id="a-2")  # decode holds the prefix now: pages skipped
    assert again.num_cached_blocks > 0
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport=transport, reason="none") == 0
    assert not p.prefill.attachments.waiting
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_bad_duplicate_unknown_and_foreign_attaches_are_refused_and_change_nothing(pair) -> None:  # noqa: F811
    p = await pair("shm")
    ids = PROMPTS[0]
    call = asyncio.ensure_future(p.pstub.Prefill(_early(p, ids)))
    resv = await _reserve(p, ids)
    good = _attach(p, resv, ids)
    cases: list[tuple[prefill_pb2.AttachReservationRequest, grpc.StatusCode, str]] = []
    for field, value, code in [
        ("attach_id", "", grpc.StatusCode.INVALID_ARGUMENT),
        ("reservation_token", b"", grpc.StatusCode.INVALID_ARGUMENT),
        ("num_skip_blocks", 99, grpc.StatusCode.INVALID_ARGUMENT),
        ("expected_layout_fingerprint", "other-layout", grpc.StatusCode.FAILED_PRECONDITION),
    ]:
        bad = prefill_pb2.AttachReservationRequest()
        bad.CopyFrom(good)
        setattr(bad, field, value)
        cases.append((bad, code, field))
    short = prefill_pb2.AttachReservationRequest()
    short.CopyFrom(good)
    del short.dest_block_ids[1:]
    cases.append((short, grpc.StatusCode.INVALID_ARGUMENT, "dest_block_ids"))
    outside = prefill_pb2.AttachReservationRequest()
    outside.CopyFrom(good)
    outside.dest_block_ids[0] = 10_000  # outside decode's pool: refused by the writer's set-up in the request
    cases.append((outside, grpc.StatusCode.INVALID_ARGUMENT, "dest_block_ids"))
    for bad, code, field in cases:
        err = await _refused(p.pstub.AttachReservation(bad))
        assert (err.code(), detail_of(err).field) == (code, field), (field, err.details())
        assert err.details()
    foreign = prefill_pb2.AttachReservationRequest()
    foreign.CopyFrom(good)
    foreign.request_id = "someone-else"
    for unknown in (_attach(p, resv, ids, attach_id="nobody"), foreign):
        err = await _refused(p.pstub.AttachReservation(unknown))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no early Prefill" in err.details()
    assert not call.done() and p.prefill.attachments.waiting  # still waiting for a good one
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.AttachReservation(good)
    err = await _refused(p.pstub.AttachReservation(good))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and detail_of(err).field == "attach_id"
    await call
    assert await consume == _want(ids)
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_an_early_prefill_carrying_a_reservation_field_is_invalid(pair) -> None:  # noqa: F811
    p = await pair("grpc")
    req = _early(p, PROMPTS[0])
    req.reservation_id = "r-1"
    err = await _refused(p.pstub.Prefill(req))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and detail_of(err).field == "reservation_id"


@pytest.mark.parametrize("transport", ["grpc", "shm"])
async def test_no_attach_within_claim_wait_s_fails_retryable_and_frees_everything(pair, transport: str) -> None:  # noqa: F811
    p = await pair(transport)
    p.prefill.config.claim_wait_s = 0.3
    err = await _refused(p.pstub.Prefill(_early(p, PROMPTS[1])))
    d = detail_of(err)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and d.retryable
    assert d.reason != Reason.ERROR_REASON_KV_HANDOFF_FAILED  # the router retries it on another prefill
    assert "no AttachReservation" in err.details()
    aborted = "pdserve_prefill_requests_aborted_total"
    assert p.metric(aborted, reason="attach_timeout") == 1 and p.metric(aborted, reason="kv_handoff") == 0
    failures = [s for mf in p.registry.collect() for s in mf.samples
                if s.name == "pdserve_prefill_kv_transfer_failures_total" and s.value]
    assert not failures, failures  # decode was never contacted
    assert not p.prefill.attachments.waiting and not p.prefill.streams
    await _assert_freed(p.prefill.engine)  # held blocks of the computed prompt too


@pytest.mark.parametrize("when", ["computing", "computed"])
async def test_a_cancelled_early_prefill_frees_everything(pair, when: str) -> None:  # noqa: F811
    p = await pair("grpc", slowdown_ms=30 if when == "computing" else 0)
    call = p.pstub.Prefill(_early(p, PROMPTS[1]))
    done = (lambda: _computed(p) >= 1) if when == "computing" else (lambda: _prompt_done(p))
    await _until(done, HANG_GUARD)
    assert done()
    call.cancel()
    await _assert_freed(p.prefill.engine)
    await _until(lambda: not p.prefill.attachments.waiting)
    assert not p.prefill.attachments.waiting and p.prefill.inflight == 0


async def test_a_refused_claim_stops_the_request_before_its_last_chunk(pair) -> None:  # noqa: F811
    p = await pair("shm", slowdown_ms=60)
    computed: list[bool] = []
    p.prefill.engine.engine.chunk_listeners.append(lambda ch, sampled: computed.append(bool(ch.sample)))
    ids, other_ids = PROMPTS[1], PROMPTS[0]
    resv = await _reserve(p, ids)
    other = await _reserve(p, other_ids)
    req = _request(p, resv, ids)
    req.dest_block_ids[0] = other.block_ids[0]  # another reservation's block: decode refuses the claim at once
    err = await _refused(p.pstub.Prefill(req))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "claim.dest_block_ids" in err.details()
    assert computed and not any(computed), computed  # stopped when refused, never computed to its last chunk
    await _assert_freed(p.prefill.engine)


async def test_with_mtls_only_the_router_may_attach(make_prefill, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    tls = {role: TLSConfig(**{k: str(certs / f) for k, f in
                              (("tls_cert", f"{role}.pem"), ("tls_key", f"{role}-key.pem"), ("tls_ca", "ca.pem"))})
           for role in ("prefill", "router", "decode")}
    cfg = PrefillConfig(**dataclasses.asdict(tls["prefill"]))
    rig = await make_prefill(config=cfg, server_tls=tls["prefill"])
    async with create_channel(rig.address, tls=tls["router"]) as rch, \
            create_channel(rig.address, tls=tls["decode"]) as dch:
        router, other = prefill_pb2_grpc.PrefillStub(rch), prefill_pb2_grpc.PrefillStub(dch)
        ids = PROMPTS[0]
        call = router.Prefill(prefill_pb2.PrefillRequest(request_id="req", token_ids=ids, attach_id=ATTACH_ID,
                                                         params=prefill_request(ids).params))
        att = prefill_pb2.AttachReservationRequest(request_id="req", attach_id=ATTACH_ID, decode_address="decode-x",
                                                   reservation_id="resv", reservation_token=TOKEN)
        err = await _refused(other.AttachReservation(att))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert detail_of(err).reason == Reason.ERROR_REASON_PERMISSION
        await router.AttachReservation(att)
        resp = await call
        assert resp.num_prompt_tokens == len(ids) and rig.receiver.chunks[-1].is_last


async def test_an_attach_taken_by_a_request_that_then_ends_is_answered(pair) -> None:  # noqa: F811
    p = await pair("shm")
    make, entered = p.prefill.direct.writer, asyncio.Event()

    async def slow_writer(*args, **kw):  # the writer set-up takes long: the request is cancelled meanwhile
        entered.set()
        await asyncio.sleep(2.0)
        return await make(*args, **kw)

    p.prefill.direct.writer = slow_writer  # type: ignore[method-assign]
    ids = PROMPTS[0]
    call = p.pstub.Prefill(_early(p, ids))
    resv = await _reserve(p, ids)
    attach = asyncio.ensure_future(p.pstub.AttachReservation(_attach(p, resv, ids), timeout=30))
    await entered.wait()
    call.cancel()
    err = await _refused(attach)  # at once, not after the attach's 30 s deadline
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "ended before" in err.details()
    await _assert_freed(p.prefill.engine)
    # The cancelled handler drops its entry in its finally, after its cleanup freed the blocks: moments later.
    await _until(lambda: not p.prefill.attachments.waiting)
    assert not p.prefill.attachments.waiting


async def test_an_attach_is_answered_while_the_engine_thread_is_busy(pair) -> None:  # noqa: F811
    p = await pair("shm")
    ids = PROMPTS[0]
    release = threading.Event()
    busy = asyncio.ensure_future(p.prefill.engine.call(release.wait))  # the current step: admission queues
    try:
        call = p.pstub.Prefill(_early(p, ids))
        resv = await _reserve(p, ids)
        consume = asyncio.create_task(_generate(p, resv))
        await asyncio.wait_for(p.pstub.AttachReservation(_attach(p, resv, ids)), HANG_GUARD / 1000)
        assert not call.done()  # not admitted yet: the attach did not wait for that
    finally:
        release.set()
        await busy
    await call
    assert await consume == _want(ids)
    await _assert_freed(p.decode.engine, p.prefill.engine)


def _attach_task(name: str = "_await_attach") -> asyncio.Task:
    (task,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith(name)]
    return task


async def test_an_attach_taken_off_the_queue_as_the_wait_is_cancelled_is_answered(pair) -> None:  # noqa: F811
    p = await pair("grpc")
    ids = PROMPTS[0]
    call = p.pstub.Prefill(_early(p, ids))
    await _until(lambda: ATTACH_ID in p.prefill.attachments.waiting)
    await _until(lambda: any(t.get_coro().__qualname__.endswith("_await_attach") for t in asyncio.all_tasks()))
    waiting, wait = p.prefill.attachments.waiting[ATTACH_ID], _attach_task()
    resv = await _reserve(p, ids)
    offer = Offer(merged(waiting.request, _attach(p, resv, ids)), asyncio.get_running_loop().create_future())
    waiting.offers.put_nowait(offer)
    while not waiting.offers.empty():  # noqa: ASYNC110 (the wait's get took it; the wait has not resumed yet)
        await asyncio.sleep(0)
    wait.cancel()
    with pytest.raises(AttachRefused, match="ended before"):
        await asyncio.wait_for(offer.answer, HANG_GUARD / 1000)
    call.cancel()  # the handler ended cancelled (its wait was): gRPC has no status for it
    await _assert_freed(p.prefill.engine)
    await _until(lambda: not p.prefill.attachments.waiting)  # its finally runs after the cleanup (see above)
    assert not p.prefill.attachments.waiting
