"""PushKV on a real decode servicer: the reservation token, range checks, broken and rejected streams.

Every scenario ends with every KV block free again (the engine's published count equals the start)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.grpc_util import Reason
from services.engine.engine import LLMEngine
from services.text.sampling_params import InvalidRequestError, SamplingParams
from tests.decode.kv_util import (
    PROMPT,
    chunks,
    delivered,
    ecfg,
    idle,
    prompt,
    push,
    reference,
    reserve,
    reserved,
    run_to_end,
)

BROKEN = "pdserve_decode_kv_streams_broken_total"
REJECTED = "pdserve_decode_kv_chunks_rejected_total"


async def test_push_needs_the_reservation_token_and_a_wrong_one_changes_nothing(decode_rig):
    rig = await decode_rig()
    base, ref, resv = await reserved(rig)
    assert len(resv.reservation_token) == 16
    for token in (b"", bytes(16), resv.reservation_token[:-1] + bytes([resv.reservation_token[-1] ^ 1])):
        out = await push(rig.stub, chunks(resv, PROMPT, ref, token=token))
        assert out.code == grpc.StatusCode.PERMISSION_DENIED, out
        assert out.detail.reason == Reason.ERROR_REASON_PERMISSION and out.detail.side == "decode"
        assert "reservation_token" in out.details
        assert (await rig.engine.stats())["waiting_for_kv"] == 1  # untouched
    # A right first chunk followed by a forged one: refused, nothing freed, the stream's progress dropped.
    good = chunks(resv, PROMPT, ref)
    forged = chunks(resv, PROMPT, ref, token=bytes(16))
    out = await push(rig.stub, [good[0], forged[1]])
    assert out.code == grpc.StatusCode.PERMISSION_DENIED
    r = rig.servicer.table.get(resv.reservation_id)
    assert r is not None and r.next_chunk == 0 and not r.pages_written and not r.receiving
    # The rightful sender still completes it, and the tokens are an uninterrupted run's.
    assert (await push(rig.stub, good)).code == grpc.StatusCode.OK
    assert await run_to_end(rig.stub, resv) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_huge_first_token_is_refused_and_the_engine_keeps_serving(decode_rig):
    rig = await decode_rig()
    base, ref, resv = await reserved(rig)
    out = await push(rig.stub, chunks(resv, PROMPT, ref, first_token=2_000_000_000))
    assert out.code == grpc.StatusCode.INVALID_ARGUMENT and "first_token" in out.details
    assert out.detail.reason == Reason.ERROR_REASON_INVALID_INPUT and out.detail.field == "first_token"
    assert rig.servicer.table.get(resv.reservation_id) is None  # a protocol violation frees it
    assert rig.metric(REJECTED, reason="range") == 1
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]
    # Nothing died: a normal request afterwards decodes the uninterrupted run's tokens.
    assert rig.engine.dead is None
    resv = await reserve(rig.stub)
    assert await delivered(rig.stub, resv, PROMPT, ref) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


@pytest.mark.parametrize("how", ["cancelled", "closed_early"])
async def test_broken_stream_keeps_the_reservation_for_a_fresh_stream(decode_rig, how):
    rig = await decode_rig()
    base, ref, resv = await reserved(rig)
    msgs = chunks(resv, PROMPT, ref)
    r = rig.servicer.table.get(resv.reservation_id)
    assert r is not None
    if how == "cancelled":  # the prefill died after its first chunk: the call goes away mid-stream
        hold = asyncio.Event()

        async def gen():
            yield msgs[0]
            await hold.wait()

        call = rig.stub.PushKV(gen())
        for _ in range(200):
            if r.next_chunk == 1:
                break
            await asyncio.sleep(0.02)
        assert r.next_chunk == 1 and r.receiving
        call.cancel()
        for _ in range(200):
            if not r.receiving:
                break
            await asyncio.sleep(0.02)
    else:  # the stream ended without its last chunk
        out = await push(rig.stub, msgs[:2])
        assert out.code == grpc.StatusCode.ABORTED and out.detail.retryable
        assert out.detail.reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert not r.receiving and r.next_chunk == 0 and not r.pages_written
    assert rig.servicer.table.get(resv.reservation_id) is r and r.end_cause is None
    assert rig.metric(BROKEN, model=rig.servicer.model) == 1
    assert (await rig.engine.stats())["waiting_for_kv"] == 1
    # A retried prefill sends a fresh stream from chunk 0: same tokens as an uninterrupted run.
    assert (await push(rig.stub, msgs)).code == grpc.StatusCode.OK
    assert await run_to_end(rig.stub, resv) == ref.tokens
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_lease_running_out_mid_stream_ends_the_stream_and_frees_the_blocks(decode_rig):
    rig = await decode_rig()
    ids = prompt(3)
    base, ref, resv = await reserved(rig, ids, 4, lease_ms=400)
    msgs = chunks(resv, ids, ref)
    hold = asyncio.Event()

    async def gen():
        yield msgs[0]
        await hold.wait()  # a stalled sender

    try:
        await rig.stub.PushKV(gen(), timeout=10)
        raise AssertionError("the stream should have been refused")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND
    assert rig.servicer.table.get(resv.reservation_id) is None
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]


async def test_protocol_violations_free_the_reservation(decode_rig):
    rig = await decode_rig()
    base = await idle(rig.engine)
    ref = reference(PROMPT, 6)
    for mutate, code, field in [
        (lambda c: setattr(c, "chunk_index", 5), grpc.StatusCode.INVALID_ARGUMENT, "chunk_index"),
        (lambda c: setattr(c, "num_pages", 4_000_000_000), grpc.StatusCode.INVALID_ARGUMENT, "first_block"),
        (lambda c: setattr(c, "token_end", 4_000_000_000), grpc.StatusCode.INVALID_ARGUMENT, "token_end"),
        (lambda c: setattr(c, "checksum", c.checksum ^ 1), grpc.StatusCode.DATA_LOSS, "checksum"),
        (lambda c: setattr(c, "layout_fingerprint", "feedfacefeedface"), grpc.StatusCode.FAILED_PRECONDITION,
         "layout_fingerprint"),
    ]:
        resv = await reserve(rig.stub)
        msgs = chunks(resv, PROMPT, ref)
        mutate(msgs[0])
        out = await push(rig.stub, msgs)
        assert out.code == code and out.detail.field == field and out.detail.side == "decode", out
        assert rig.servicer.table.get(resv.reservation_id) is None
        assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"]
    out = await push(rig.stub, chunks(resv, PROMPT, ref))  # that reservation is gone
    assert out.code == grpc.StatusCode.NOT_FOUND and out.detail.reason == Reason.ERROR_REASON_RESERVATION_GONE


def test_engine_kv_import_done_is_safe_for_a_gone_request_and_a_bad_token():
    eng = LLMEngine(ecfg())
    eng.add_kv_import("a", PROMPT, SamplingParams(max_tokens=2, temperature=0))
    with pytest.raises(InvalidRequestError, match="first_token"):
        eng.kv_import_done("a", 2_000_000_000, None)
    assert eng.scheduler.num_waiting_for_kv == 1 and eng.scheduler.num_running == 0  # untouched
    eng.abort("a")
    assert eng.kv_import_done("a", 5, None) is None  # aborted just as its KV landed: no KeyError
    assert eng.kv_import_done("never", 5, None) is None
    assert eng.block_manager.num_free_blocks == eng.runner.num_blocks
