"""Side-transport writers claim a reservation before writing into decode's pool.

The wave-1 bug: a prefill wrote pages into decode's shm pool before its PushKV stream was open; a lease
running out (or an Abort) meanwhile freed the blocks and handed them to another request while the
prefill was still writing. Now decode acknowledges a claim first, and never frees a claimed
reservation's blocks while the writer's stream is open."""

from __future__ import annotations

import asyncio

import grpc

from services.common.grpc_util import Reason
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2_grpc
from services.engine.kv_transport import CLAIM_ACK, KVPoll
from tests.decode.kv_util import PROMPT, idle, prompt, refused, reserve

SHARED = dict(kv_cache_shared=True)


def _claim(resv, *, blocks=None, pool=None, token=None) -> common_pb2.KVChunk:
    return common_pb2.KVChunk(
        request_id="r", reservation_id=resv.reservation_id, transport="shm",
        reservation_token=resv.reservation_token if token is None else token,
        claim=common_pb2.KVClaim(transport="shm", dest_block_ids=list(resv.block_ids) if blocks is None else blocks,
                                 pool_id=pool_id(resv.destination) if pool is None else pool))


async def _shared(decode_rig, **reserve_kw: object):
    """A decode whose KV pool is shared (shm), its idle engine's stats, and one reservation on it."""
    rig = await decode_rig(engine=SHARED)
    base = await idle(rig.engine)
    return rig, base, await reserve(rig.stub, **reserve_kw)


async def _abort(rig, *reservations) -> None:
    for r in reservations:
        await rig.stub.Abort(common_pb2.AbortRequest(request_id=r.reservation_id))


async def _claimed_call(stub: decode_pb2_grpc.DecodeStub, claim: common_pb2.KVChunk):
    """A PushKV call that sent ``claim``; returns (call, acknowledged)."""
    call = stub.PushKV()
    await call.write(claim)
    md = await call.initial_metadata()
    return call, all(kv in list(md or ()) for kv in CLAIM_ACK)


def _descriptor(resv) -> common_pb2.KVChunk:
    """An in-place (shm) last-chunk descriptor covering all of ``resv``'s blocks."""
    return common_pb2.KVChunk(
        request_id="r", reservation_id=resv.reservation_id, chunk_index=0, first_block=0,
        num_pages=len(resv.block_ids), token_end=len(PROMPT), transport="shm", is_last=True,
        layout_fingerprint=resv.layout.fingerprint, reservation_token=resv.reservation_token)


async def test_a_claimed_reservation_keeps_its_blocks_past_its_lease_until_the_writer_leaves(decode_rig):
    rig, base, resv = await _shared(decode_rig, lease_ms=300)
    assert resv.destination.WhichOneof("pool") == "shm"
    r = rig.servicer.table.get(resv.reservation_id)
    assert rig.servicer.receiver.poll(r) is KVPoll.BOOTSTRAPPING
    call, acked = await _claimed_call(rig.stub, _claim(resv))
    assert acked and rig.servicer.receiver.poll(r) is KVPoll.WAITING_FOR_INPUT
    await asyncio.sleep(0.8)  # the lease ran out while the (slow) writer holds the stream
    assert rig.servicer.table.get(resv.reservation_id) is None  # the reservation ended...
    assert rig.servicer.receiver.poll(r) is KVPoll.FAILED
    held = (await rig.engine.stats())["free_blocks"]
    assert held == base["free_blocks"] - len(resv.block_ids)  # ...but its blocks are not free for reuse
    other = await reserve(rig.stub, prompt(3))  # a new request gets other blocks
    assert not set(other.block_ids) & set(resv.block_ids)
    await call.write(_descriptor(resv))  # a late descriptor is dropped, not applied
    await call.done_writing()  # the writer's stream ends: now, and only now, the blocks are freed
    out = await refused(call)
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE
    await _abort(rig, other)
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_an_abort_while_claimed_frees_only_when_the_stream_breaks(decode_rig):
    rig, base, resv = await _shared(decode_rig)
    call, acked = await _claimed_call(rig.stub, _claim(resv))
    assert acked
    assert (await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await asyncio.sleep(0.2)
    assert (await rig.engine.stats())["free_blocks"] == base["free_blocks"] - len(resv.block_ids)
    call.cancel()  # the writer died: the stream breaks
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_a_claim_after_the_reservation_ended_is_refused_before_any_write(decode_rig):
    rig, base, resv = await _shared(decode_rig)
    await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    call, acked = await _claimed_call(rig.stub, _claim(resv))
    assert not acked
    out = await refused(call)
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_a_claim_for_another_reservations_blocks_or_pool_is_refused(decode_rig):
    rig, base, mine = await _shared(decode_rig)
    theirs = await reserve(rig.stub, prompt(5))
    cases = [
        (_claim(mine, blocks=list(theirs.block_ids)), grpc.StatusCode.PERMISSION_DENIED, "claim.dest_block_ids"),
        (_claim(mine, pool="shm:pdserve-kv-1-000000000000"), grpc.StatusCode.FAILED_PRECONDITION, "claim.pool_id"),
        (_claim(mine, token=theirs.reservation_token), grpc.StatusCode.PERMISSION_DENIED, "reservation_token"),
    ]
    for claim, code, field in cases:
        call, acked = await _claimed_call(rig.stub, claim)
        out = await refused(call)
        assert not acked and out.code == code and out.detail.field == field, (field, out)
    # Nothing was freed or changed: the rightful claim still works.
    call, acked = await _claimed_call(rig.stub, _claim(mine))
    assert acked
    call.cancel()
    await _abort(rig, mine, theirs)
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_an_in_place_descriptor_without_a_claim_is_refused(decode_rig):
    rig, base, resv = await _shared(decode_rig)
    call = rig.stub.PushKV()
    await call.write(_descriptor(resv))
    await call.done_writing()
    out = await refused(call)
    assert out.code == grpc.StatusCode.FAILED_PRECONDITION and out.detail.field == "claim"
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]
