"""Leases and deadlines: server-capped, renewable with the token, and whatever an expired or late
request holds is freed (block counts back to the start after each scenario)."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from tests.decode.kv_util import (
    PROMPT,
    chunks,
    generate,
    idle,
    prompt,
    push,
    reference,
    refused,
    reserve,
    reserved,
    slow_steps,
)

HUGE = 4294967295  # the largest uint32 lease_ms: ~50 days


async def test_a_huge_lease_is_capped_by_the_server_and_by_the_deadline(decode_rig):
    rig = await decode_rig(lease_ms=1_000, max_lease_ms=2_000)
    now = time.time()
    resv = await reserve(rig.stub, lease_ms=HUGE)
    assert now < resv.lease_expires_unix <= time.time() + 2.0
    deadline = time.time() + 1.0
    resv2 = await reserve(rig.stub, prompt(1), lease_ms=HUGE, deadline_unix=deadline)
    assert resv2.lease_expires_unix <= deadline
    for r in (resv, resv2):
        await rig.stub.Abort(common_pb2.AbortRequest(request_id=r.reservation_id))


async def test_huge_leases_cannot_starve_others_after_expiry(decode_rig):
    rig = await decode_rig(lease_ms=2_000, max_lease_ms=4_000)
    base = await idle(rig.engine)
    # 12 prompts of 5 distinct pages each take 60 of the 64 blocks (one caller alone may fill the pool).
    held = [await reserve(rig.stub, prompt(i, 80), lease_ms=HUGE) for i in range(12)]
    assert all(len(r.block_ids) == 5 for r in held)
    out = await refused(reserve(rig.stub, prompt(99, 80)))
    assert out.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert out.detail.reason == Reason.ERROR_REASON_OVERLOADED and out.detail.retryable
    assert out.detail.retry_after_ms > 0
    # Without KV the lease is --lease-ms (2 s), not the huge ask nor --max-lease-ms: all are freed.
    assert all(r.lease_expires_unix <= time.time() + 2.0 for r in held)
    s = await idle(rig.engine, timeout_s=15.0)
    assert s["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0
    assert rig.metric("pdserve_decode_reservations_expired_total", model=rig.servicer.model) == 12
    resv = await reserve(rig.stub, prompt(99, 80))
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_renew_lease_needs_the_token_and_extends_a_live_reservation(decode_rig):
    rig = await decode_rig(lease_ms=2_000, max_lease_ms=5_000)
    base, ref, resv = await reserved(rig, lease_ms=500)
    renew = rig.stub.RenewLease
    out = await refused(renew(decode_pb2.RenewLeaseRequest(reservation_id=resv.reservation_id,
                                                           reservation_token=bytes(16), lease_ms=3_000)))
    assert out.code == grpc.StatusCode.PERMISSION_DENIED and out.detail.reason == Reason.ERROR_REASON_PERMISSION
    got = await renew(decode_pb2.RenewLeaseRequest(reservation_id=resv.reservation_id,
                                                   reservation_token=resv.reservation_token, lease_ms=HUGE))
    assert resv.lease_expires_unix < got.lease_expires_unix <= time.time() + 5.0  # extended, and capped
    await asyncio.sleep(0.8)  # past the first lease: still there
    assert rig.servicer.table.get(resv.reservation_id) is not None
    assert (await push(rig.stub, chunks(resv, PROMPT, ref))).code == grpc.StatusCode.OK
    tokens, _, outcome = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert outcome.code == grpc.StatusCode.OK and tokens == ref.tokens
    out = await refused(renew(decode_pb2.RenewLeaseRequest(reservation_id=resv.reservation_id,
                                                           reservation_token=resv.reservation_token)))
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_expired_reservation_answers_reservation_gone_not_an_empty_success(decode_rig):
    rig = await decode_rig()
    base = await idle(rig.engine)
    resv = await reserve(rig.stub, lease_ms=300)
    # A Generate already waiting when the lease runs out ends with an error, not an empty ABORT finish.
    tokens, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert tokens == [] and out.code == grpc.StatusCode.NOT_FOUND
    assert out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE and out.detail.side == "decode"
    # And one that comes afterwards.
    _, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_a_request_past_its_deadline_is_stopped_and_freed(decode_rig, monkeypatch):
    rig = await decode_rig()
    base = await idle(rig.engine)
    out = await refused(reserve(rig.stub, deadline_unix=time.time() - 1))
    assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED and out.detail.reason == Reason.ERROR_REASON_DEADLINE
    ids = prompt(5)
    ref = reference(ids, 4)
    slow_steps(monkeypatch, rig.engine.engine, lambda: time.sleep(0.05))
    resv = await reserve(rig.stub, ids, max_tokens=500, ignore_eos=True, deadline_unix=time.time() + 1.0)
    assert (await push(rig.stub, chunks(resv, ids, ref))).code == grpc.StatusCode.OK
    tokens, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert out.code == grpc.StatusCode.DEADLINE_EXCEEDED and out.detail.reason == Reason.ERROR_REASON_DEADLINE
    assert 0 < len(tokens) < 500
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_landed_kv_that_no_generate_picks_up_is_freed_after_another_lease(decode_rig):
    rig = await decode_rig()
    ids = prompt(6)
    base, ref, resv = await reserved(rig, ids, 4, lease_ms=500)
    assert (await push(rig.stub, chunks(resv, ids, ref))).code == grpc.StatusCode.OK
    r = rig.servicer.table.get(resv.reservation_id)
    assert r is not None and r.complete and r.lease is not None  # now waiting to be picked up
    for _ in range(100):
        if rig.servicer.table.get(resv.reservation_id) is None:
            break
        await asyncio.sleep(0.05)
    assert rig.servicer.table.get(resv.reservation_id) is None
    _, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE
    assert rig.metric("pdserve_decode_reservations_expired_total", model=rig.servicer.model) == 0
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]
