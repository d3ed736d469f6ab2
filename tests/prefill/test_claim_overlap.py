"""A side transport's claim runs while the prompt computes (issue 10, the P/D plumbing cut): no page is
written before decode acknowledged the claim, chunks computed before that are written with a later one,
and a claim decode refuses (or never answers) ends the request with a clear status, every block freed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.grpc_util import Reason, detail_of
from services.common.pb import common_pb2
from services.engine.engine import LLMEngine
from services.engine.kv_transport.base import KVPoll
from services.engine.sampling_params import SamplingParams
from services.prefill import kv_stream
from tests.prefill.test_transports import (  # noqa: F401 (pair: the fixture)
    ENGINE,
    PROMPTS,
    Pair,
    _assert_freed,
    _generate,
    _request,
    _reserve,
    _until,
    pair,
)


def _hold_claims(p: Pair) -> asyncio.Event:
    """Decode reads no PushKV message (so answers no claim) until the returned event is set."""
    gate = asyncio.Event()
    receive = p.decode.receiver.receive

    async def gated(chunks, on_claimed=None):
        async def held():
            async for c in chunks:
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
    want = LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert await consume == want  # the pages computed before the answer were written with a later chunk
    assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
    assert states and KVPoll.BOOTSTRAPPING not in states
    assert p.metric("pdserve_prefill_handoff_phase_seconds_count", phase="claim") == 1
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_claim_refused_while_the_prompt_computes_ends_with_decodes_status(pair) -> None:  # noqa: F811
    p = await pair("shm", slowdown_ms=40)
    gate, states = _hold_claims(p), _spy_writes(p)
    ids, other_ids = PROMPTS
    resv = await _reserve(p, ids)
    other = await _reserve(p, other_ids[:len(ids)])
    req = _request(p, resv, ids)
    del req.dest_block_ids[:]
    req.dest_block_ids.extend(other.block_ids)  # another reservation's blocks: decode refuses the claim
    call = asyncio.ensure_future(p.pstub.Prefill(req))
    await _until(lambda: _computed(p) >= 1)
    assert _computed(p) >= 1
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


async def test_a_claim_unanswered_when_the_prompt_is_computed_fails_unavailable(pair, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setattr(kv_stream, "CLAIM_WAIT_S", 0.2)
    p = await pair("shm")
    gate, states = _hold_claims(p), _spy_writes(p)
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.pstub.Prefill(_request(p, resv, ids))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert "did not acknowledge the KV claim" in e.value.details()
    assert states == []
    await _assert_freed(p.prefill.engine)
    gate.set()
    r = p.decode.table.get(resv.reservation_id)
    await _until(lambda: not r.receiving)
    assert r.end_cause is None and r.next_chunk == 0  # a broken stream keeps the reservation for a retry
    assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await _assert_freed(p.decode.engine)


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
