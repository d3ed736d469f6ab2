"""A side transport's claim runs while the prompt computes (the P/D plumbing cut): no page is
written before decode acknowledged the claim, chunks computed before that are written with a later one,
a prompt computed before the answer never stalls the engine thread (its blocks are held past its end and
written once decode answers, while other requests keep stepping), and a claim decode refuses (or does not
answer within --claim-wait-s: retryable) ends the request with a clear status, every block freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.grpc_util import Reason, detail_of
from services.common.pb import common_pb2
from services.engine.engine import LLMEngine
from services.engine.kv_transport.base import KVPoll
from services.text.sampling_params import SamplingParams
from tests.prefill.test_transports import (  # noqa: F401 (pair: the fixture)
    ENGINE,
    PROMPTS,
    Pair,
    _assert_freed,
    _generate,
    _refused_unclaimed,
    _request,
    _request_into_other_blocks,
    _reserve,
    _until,
    pair,
)


def _hold_claims(p: Pair, only: set[str] | None = None) -> asyncio.Event:
    """Decode reads no PushKV message (so answers no claim) until the returned event is set; with ``only``,
    just the messages of those reservation ids."""
    gate = asyncio.Event()
    receive = p.decode.receiver.receive

    async def gated(chunks, on_claimed=None):
        async def held():
            async for c in chunks:
                if only is None or c.header.reservation_id in only:
                    await gate.wait()
                yield c

        return await receive(held(), on_claimed)

    p.decode.receiver.receive = gated  # type: ignore[method-assign]
    return gate


def _spy_writes(p: Pair) -> list[KVPoll]:
    """The state of the request's KV stream at every page write prefill's writer made (not refused)."""
    states: list[KVPoll] = []
    make = p.prefill.direct.writer

    async def writer(*args, **kw):
        w = await make(*args, **kw)
        if w is not None:
            write = w.write

            def spied(first_block, src_blocks):
                state = w.sender.poll()
                handle = write(first_block, src_blocks)  # raises, writing nothing, on a broken stream
                states.append(state)
                return handle

            w.write = spied
        return w

    p.prefill.direct.writer = writer  # type: ignore[method-assign]
    return states


def _computed(p: Pair) -> int:
    return max((s.num_chunks_computed for s in p.prefill.streams.values()), default=0)


def _prompt_done(p: Pair) -> bool:
    """Some request's last chunk was computed (its blocks are held if its claim is unanswered)."""
    return any(s.last_computed is not None for s in p.prefill.streams.values())


HANG_GUARD = 3000
"""_until tries (20 ms each: a minute) before a test gives up waiting for the engine."""


async def _held_blocks(p: Pair) -> float:
    """Prefill blocks in use with nothing running or waiting: blocks held past their request's end."""
    s = await p.prefill.engine.stats()
    assert s["running"] + s["waiting"] == 0
    return s["total_blocks"] - s["free_blocks"]


def _want(ids: list[int]) -> list[int]:
    return LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]


async def test_a_pending_claim_never_stalls_the_engine_thread_and_its_pages_land_after_the_ack(pair) -> None:  # noqa: F811
    p = await pair("shm")
    gated: set[str] = set()
    gate, states = _hold_claims(p, gated), _spy_writes(p)
    ids, other_ids = PROMPTS[1], PROMPTS[0]
    resv = await _reserve(p, ids)
    gated.add(resv.reservation_id)
    call = asyncio.ensure_future(p.pstub.Prefill(_request(p, resv, ids)))
    await _until(lambda: _prompt_done(p), HANG_GUARD)
    assert _prompt_done(p), "the first prompt was not computed"
    assert await _held_blocks(p) == len(resv.block_ids)  # kept past the request's end for the deferred write
    other = await _reserve(p, other_ids)  # a second request steps and finishes on the same engine meanwhile
    other_tokens = asyncio.create_task(_generate(p, other))
    await p.pstub.Prefill(_request(p, other, other_ids))
    assert await other_tokens == _want(other_ids)
    assert not call.done() and p.decode.table.get(resv.reservation_id).next_chunk == 0
    assert await _held_blocks(p) == len(resv.block_ids)
    gate.set()
    consume = asyncio.create_task(_generate(p, resv))
    resp = await call
    assert await consume == _want(ids)  # every page, written after decode's ack
    assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
    assert states and KVPoll.BOOTSTRAPPING not in states
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_the_claim_overlaps_compute_and_no_page_is_written_before_its_answer(pair) -> None:  # noqa: F811
    p = await pair("shm", slowdown_ms=40)
    gate, states = _hold_claims(p), _spy_writes(p)
    ids = PROMPTS[1]  # 130 tokens, 16-token chunks: 9 chunks
    resv = await _reserve(p, ids)
    call = asyncio.ensure_future(p.pstub.Prefill(_request(p, resv, ids)))
    await _until(lambda: _computed(p) >= 2)
    assert _computed(p) >= 2, "the prompt did not compute while its claim was unanswered"
    assert states == [] and p.decode.table.get(resv.reservation_id).next_chunk == 0
    gate.set()
    consume = asyncio.create_task(_generate(p, resv))
    resp = await call
    assert await consume == _want(ids)  # the pages computed before the answer were written with a later chunk
    assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
    assert states and KVPoll.BOOTSTRAPPING not in states
    assert p.metric("pdserve_prefill_handoff_phase_seconds_count", phase="claim") == 1
    await _assert_freed(p.decode.engine, p.prefill.engine)


@pytest.mark.parametrize("when", ["computing", "computed"])
async def test_a_refused_claim_ends_with_decodes_status(pair, when: str) -> None:  # noqa: F811
    p = await pair("shm", slowdown_ms=40 if when == "computing" else 0)
    gate, states = _hold_claims(p), _spy_writes(p)
    ids, other_ids = PROMPTS
    resv, other, req = await _request_into_other_blocks(p, ids, other_ids)  # decode refuses the claim
    call = asyncio.ensure_future(p.pstub.Prefill(req))
    done = (lambda: _computed(p) >= 1) if when == "computing" else (lambda: _prompt_done(p))
    await _until(done, HANG_GUARD)
    assert done()
    gate.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # decode's answer, not the broken stream's
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert "claim.dest_block_ids" in e.value.details()
    assert states == []
    assert p.metric("pdserve_prefill_kv_transfer_failures_total", transport="shm", reason="permission_denied") == 1
    for x in (resv, other):
        assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=x.reservation_id))).found
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_claim_unanswered_within_claim_wait_s_is_retryable_with_the_same_reservation(pair) -> None:  # noqa: F811
    p = await pair("shm")
    p.prefill.config.claim_wait_s = 0.2  # the gate below never opens in time: the bound always passes
    gate, states = _hold_claims(p), _spy_writes(p)
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    await _refused_unclaimed(p, resv, ids)
    assert states == []
    await _assert_freed(p.prefill.engine)  # the held blocks too
    gate.set()
    r = p.decode.table.get(resv.reservation_id)
    await _until(lambda: not r.receiving, HANG_GUARD)
    assert r.end_cause is None and r.next_chunk == 0  # a broken stream keeps the reservation for a retry
    p.prefill.config.claim_wait_s = 60.0
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))  # the retry the router makes, with the same reservation
    assert await consume == _want(ids)
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_prefill_gone_mid_claim_writes_nothing_and_frees_its_blocks(pair) -> None:  # noqa: F811
    p = await pair("shm", slowdown_ms=40)
    gate, states = _hold_claims(p), _spy_writes(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    call = p.pstub.Prefill(_request(p, resv, ids))
    await _until(lambda: _computed(p) >= 1)
    assert _computed(p) >= 1
    call.cancel()  # the caller left with the claim unanswered: prefill stops, nothing may be written
    await _assert_freed(p.prefill.engine)
    assert states == []  # not even the chunks computed while it stopped
    gate.set()
    assert p.decode.table.get(resv.reservation_id).next_chunk == 0  # decode kept the reservation for a retry
    assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await _assert_freed(p.decode.engine)


async def test_a_prefill_gone_with_its_blocks_held_for_the_claim_frees_them(pair) -> None:  # noqa: F811
    p = await pair("shm")
    gate, states = _hold_claims(p), _spy_writes(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    call = p.pstub.Prefill(_request(p, resv, ids))
    await _until(lambda: _prompt_done(p), HANG_GUARD)
    assert _prompt_done(p) and await _held_blocks(p) == len(resv.block_ids)
    call.cancel()
    await _assert_freed(p.prefill.engine)
    gate.set()
    assert states == [] and p.decode.table.get(resv.reservation_id).next_chunk == 0
    assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await _assert_freed(p.decode.engine)
