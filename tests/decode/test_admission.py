"""Admission at decode's boundary: range checks name the field, a bounded queue answers OVERLOADED,
draining refuses new work but serves existing reservations."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common import metrics as m
from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from tests.decode.kv_util import (
    PROMPT,
    delivered,
    generate,
    idle,
    prompt,
    reference,
    refused,
    reserve,
    reserved,
)

P = common_pb2.SamplingParams


async def test_reserve_range_checks_name_the_field_and_the_service_keeps_serving(decode_rig):
    rig = await decode_rig()
    base = await idle(rig.engine)
    cases = [
        (dict(request_id="", token_ids=PROMPT, params=P(max_tokens=4)), "request_id"),
        (dict(request_id="x", token_ids=[], params=P(max_tokens=4)), "token_ids"),
        (dict(request_id="x", token_ids=[*PROMPT, 512], params=P(max_tokens=4)), "token_ids"),
        (dict(request_id="x", token_ids=[-1, *PROMPT], params=P(max_tokens=4)), "token_ids"),
        (dict(request_id="x", token_ids=[1] * 1024, params=P(max_tokens=4)), "token_ids"),
        (dict(request_id="x", token_ids=PROMPT, params=P(max_tokens=0)), "params.max_tokens"),
        (dict(request_id="x", token_ids=PROMPT, params=P(max_tokens=4, temperature=-2)), "params.temperature"),
        (dict(request_id="x", token_ids=PROMPT, params=P(max_tokens=4, top_p=2.0)), "params.top_p"),
        (dict(request_id="x", token_ids=PROMPT, params=P(max_tokens=4), deadline_unix=float("nan")),
         "deadline_unix"),
    ]
    for fields, field in cases:
        out = await refused(rig.stub.Reserve(decode_pb2.ReserveRequest(**fields)))
        assert out.code == grpc.StatusCode.INVALID_ARGUMENT, (field, out)
        assert out.detail.reason == Reason.ERROR_REASON_INVALID_INPUT and out.detail.field == field, out
        assert field.split(".")[-1] in out.details
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0
    ref = reference(PROMPT, 6)
    resv = await reserve(rig.stub)
    assert await delivered(rig.stub, resv, PROMPT, ref) == ref.tokens


async def test_bounded_queue_answers_overloaded_with_retry_after(decode_rig):
    rig = await decode_rig(mode="colocated", max_pending=2, overload_retry_after_ms=750)
    base = await idle(rig.engine)
    held = [await reserve(rig.stub, prompt(i)) for i in range(2)]
    assert rig.servicer.admission(await rig.engine.stats()) == (2, True)
    colocated = decode_pb2.DecodeGenerateRequest(request_id="c", token_ids=PROMPT, params=P(max_tokens=2))
    for out in (await refused(reserve(rig.stub, prompt(7))), (await generate(rig.stub, colocated))[2]):
        assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED, out
        assert out.detail.reason == Reason.ERROR_REASON_OVERLOADED and out.detail.retryable
        assert out.detail.retry_after_ms == 750
    assert rig.metric("pdserve_decode_requests_refused_total", reason="overloaded") == 2
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=held[0].reservation_id))
    resv = await reserve(rig.stub, prompt(7))
    for r in (held[1], resv):
        assert (await rig.stub.Abort(common_pb2.AbortRequest(request_id=r.reservation_id))).found
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_draining_refuses_new_work_and_serves_existing_reservations(decode_rig):
    rig = await decode_rig(mode="colocated")
    base, ref, resv = await reserved(rig)
    rig.servicer.draining.set()
    out = await refused(reserve(rig.stub, prompt(2)))
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_DRAINING
    _, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(request_id="c", token_ids=PROMPT,
                                                                          params=P(max_tokens=2)))
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_DRAINING
    assert await delivered(rig.stub, resv, PROMPT, ref) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_colocated_request_id_cannot_hijack_a_reservations_stream(decode_rig):
    rig = await decode_rig(mode="colocated")
    base, ref, resv = await reserved(rig)
    tokens, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(
        request_id=resv.reservation_id, token_ids=PROMPT, params=P(max_tokens=2, temperature=0)))
    assert out.code == grpc.StatusCode.OK and tokens == ref.tokens[:2]
    assert await delivered(rig.stub, resv, PROMPT, ref) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_reserve_offers_the_wire_codecs_and_a_shared_pool_as_typed_fields(decode_rig):
    rig = await decode_rig()
    resv = await reserve(rig.stub)
    assert list(resv.accepted_wire_fingerprints) == [rig.engine.engine.fp8_layout.fingerprint]
    assert not resv.HasField("destination")  # a private pool: nothing to offer
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    shared = await decode_rig(engine=dict(kv_cache_shared=True))
    if shared.engine.engine.runner.kv_destination is None:
        return  # /dev/shm had no room: the pool stayed private (logged)
    resv = await reserve(shared.stub)
    assert resv.destination.WhichOneof("pool") == "shm"
    assert resv.destination.shm.name.startswith("pdserve-kv-") and "/" not in resv.destination.shm.name
    await shared.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))


async def test_a_reserve_short_of_blocks_waits_its_turn_and_gives_up_clearly(decode_rig):
    """With the pool full, a Reserve that asks to wait (block_wait_ms) waits, holding nothing and counted as pending,
    until blocks free, then gets them; one that does not ask is refused at once; one whose wait (capped by
    --reserve-wait-s) runs out first answers OVERLOADED with Retry-After; nothing is held after."""
    rig = await decode_rig(reserve_wait_s=10.0)  # one caller (loopback): its share is the whole pool, never a refusal
    base = await idle(rig.engine)
    # 12 prompts of 5 distinct pages take 60 of the 64 blocks; a 13th needs 5.
    held = [await reserve(rig.stub, prompt(i, 80), request_id=f"h{i}") for i in range(12)]
    stub = rig.stub
    out = await refused(reserve(stub, prompt(99, 80), request_id="now"))  # no block_wait_ms: refused at once
    assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and rig.servicer._block_waiters == 0
    waiting = asyncio.ensure_future(reserve(stub, prompt(99, 80), request_id="w", block_wait_ms=60_000))
    for _ in range(100):
        if rig.servicer._block_waiters == 1:
            break
        await asyncio.sleep(0.02)
    assert rig.servicer._block_waiters == 1 and not waiting.done()
    assert rig.servicer._pending(await rig.engine.stats()) >= 13
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=held[0].reservation_id))
    got = await asyncio.wait_for(waiting, 10)
    assert len(got.block_ids) == 5 and rig.servicer._block_waiters == 0
    rig.servicer.config.reserve_wait_s = 0.4  # caps what the caller asks
    t0 = time.monotonic()
    out = await refused(reserve(stub, prompt(98, 80), request_id="late", block_wait_ms=60_000))
    assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "--reserve-wait-s" in out.details
    assert out.detail.reason == Reason.ERROR_REASON_OVERLOADED and out.detail.retry_after_ms > 0
    assert time.monotonic() - t0 >= 0.3 and rig.servicer._block_waiters == 0
    for r in (*held[1:], got):
        assert (await rig.stub.Abort(common_pb2.AbortRequest(request_id=r.reservation_id))).found
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0


async def test_a_queue_for_blocks_that_moves_waits_past_the_stall_limit_and_is_served_in_arrival_order(decode_rig):
    """--reserve-wait-s bounds how long the queue for free blocks may go without anyone getting theirs, not each
    Reserve's wait: two Reserves queued behind a full pool, blocks freed one request's worth at a time (each
    inside the stall limit of the last admission), both get their blocks, in arrival order, the second after
    waiting longer in all than the stall limit; Reserves queued when draining begins end UNAVAILABLE (DRAINING)
    at once; a Reserve queued on a pool that then stops turning over is refused OVERLOADED naming the stall."""
    stall = 3.0
    rig = await decode_rig(reserve_wait_s=stall)
    base = await idle(rig.engine)
    held = [await reserve(rig.stub, prompt(i, 80), request_id=f"h{i}") for i in range(12)]  # 60 of 64 blocks
    order: list[str] = []

    async def wait(rid: str) -> decode_pb2.ReserveResponse:
        got = await reserve(rig.stub, prompt(90 + len(rid), 80), request_id=rid, block_wait_ms=60_000)
        order.append(rid)
        return got

    t0 = time.monotonic()
    first = asyncio.ensure_future(wait("a"))
    for _ in range(100):
        if rig.servicer._block_waiters == 1:
            break
        await asyncio.sleep(0.02)
    second = asyncio.ensure_future(wait("bb"))
    for _ in range(100):
        if rig.servicer._block_waiters == 2:
            break
        await asyncio.sleep(0.02)
    assert rig.servicer._block_waiters == 2 and not first.done() and not second.done()
    model = rig.servicer.model
    assert rig.metric(m.DECODE_WAITING_FOR_BLOCKS_REQUESTS, model=model) == 2
    await asyncio.sleep(stall * 0.6)
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=held[0].reservation_id))
    got_a = await asyncio.wait_for(first, 10)
    assert not second.done()
    await asyncio.sleep(max(0.0, stall * 1.3 - (time.monotonic() - t0)))  # past the stall limit since it queued
    assert not second.done(), "a moving queue's Reserve was refused at the stall limit"
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=held[1].reservation_id))
    got_b = await asyncio.wait_for(second, 10)
    assert order == ["a", "bb"] and time.monotonic() - t0 > stall
    assert len(got_a.block_ids) == len(got_b.block_ids) == 5 and rig.servicer._block_waiters == 0
    assert rig.metric(m.DECODE_WAITING_FOR_BLOCKS_REQUESTS, model=model) == 0
    queued = [asyncio.ensure_future(refused(reserve(rig.stub, prompt(95 + i, 80), request_id=f"q{i}",
                                                    block_wait_ms=60_000))) for i in range(2)]
    for _ in range(100):
        if rig.servicer._block_waiters == 2:
            break
        await asyncio.sleep(0.02)
    rig.servicer.draining.set()  # waiting Reserves end at once, head first, instead of waiting for blocks
    try:
        for out in await asyncio.wait_for(asyncio.gather(*queued), 10):
            assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_DRAINING
    finally:
        rig.servicer.draining.clear()
    rig.servicer.config.reserve_wait_s = 0.4
    out = await refused(reserve(rig.stub, prompt(97, 80), request_id="stuck", block_wait_ms=60_000))
    assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED and out.detail.reason == Reason.ERROR_REASON_OVERLOADED
    assert "--reserve-wait-s" in out.details and "not turning over" in out.details and out.detail.retry_after_ms > 0
    assert rig.servicer._block_waiters == 0
    for r in (*held[2:], got_a, got_b):
        assert (await rig.stub.Abort(common_pb2.AbortRequest(request_id=r.reservation_id))).found
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0
