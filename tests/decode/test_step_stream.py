"""Decode.Stream: one router's requests over one stream (per-step batches, per-request errors, cancel,
the stream going away), against a real grpc.aio server over a small random-weight engine."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.grpc_util import Reason, detail_of
from services.common.pb import common_pb2, decode_pb2
from services.router.decode_stream import DecodeStreams
from tests.decode.kv_util import PROMPT, chunks, generate, idle, prompt, push, reserved

P = common_pb2.SamplingParams


def colocated(i: int, max_tokens: int, **kw: object) -> decode_pb2.DecodeGenerateRequest:
    return decode_pb2.DecodeGenerateRequest(request_id=f"c{i}", token_ids=prompt(i),
                                            params=P(max_tokens=max_tokens, temperature=0, **kw))


async def drain(streams: DecodeStreams, req: decode_pb2.DecodeGenerateRequest, timeout_s: float = 60.0
                ) -> tuple[list[common_pb2.GenerateResponse], grpc.aio.AioRpcError | None]:
    msgs: list[common_pb2.GenerateResponse] = []
    try:
        async with contextlib.aclosing(streams.generate(req, timeout_s=timeout_s)) as g:
            async for m in g:
                msgs.append(m)
    except grpc.aio.AioRpcError as e:
        return msgs, e
    return msgs, None


async def test_many_requests_share_one_stream_with_their_own_order_finish_and_usage(decode_rig):
    rig = await decode_rig(mode="colocated")
    base = await idle(rig.engine)
    reqs = [colocated(i, 5 + i % 3, ignore_eos=True) for i in range(10)]
    alone = [await generate(rig.stub, r) for r in reqs]  # the per-request Generate stream of each
    steps: list[decode_pb2.StreamStep] = []
    controls: asyncio.Queue[decode_pb2.StreamControl | None] = asyncio.Queue()
    for key, r in enumerate(reqs, 1):
        controls.put_nowait(decode_pb2.StreamControl(start=decode_pb2.StreamStart(key=key, request=r)))

    async def sends():
        while (c := await controls.get()) is not None:
            yield c

    call = rig.stub.Stream(sends(), timeout=120)
    done: set[int] = set()
    async for step in call:
        steps.append(step)
        assert not step.errors
        done |= {t.key for t in step.tokens if t.response.finish_reason}
        if len(done) == len(reqs):
            controls.put_nowait(None)
    per_key: dict[int, list[common_pb2.GenerateResponse]] = {}
    for step in steps:
        for t in step.tokens:
            per_key.setdefault(t.key, []).append(t.response)
    for key, (r, (tokens, reason, out)) in enumerate(zip(reqs, alone, strict=True), 1):
        msgs = per_key[key]
        assert [t for m in msgs for t in m.token_ids] == tokens and out.code == grpc.StatusCode.OK
        assert all(m.request_id == r.request_id for m in msgs)
        assert [m.finish_reason for m in msgs[:-1]] == [0] * (len(msgs) - 1)
        assert msgs[-1].finish_reason == reason == common_pb2.FINISH_REASON_LENGTH
        assert msgs[-1].usage.prompt_tokens == len(r.token_ids)
        assert msgs[-1].usage.completion_tokens == r.params.max_tokens
    assert max(len(s.tokens) for s in steps) > 1  # a step's tokens of several requests left in one message
    assert len(steps) < sum(len(v) for v in per_key.values())
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and rig.servicer.generating == 0


async def test_a_refused_request_fails_alone_with_its_status_and_detail(decode_rig):
    rig = await decode_rig(mode="colocated")
    base = await idle(rig.engine)
    streams = DecodeStreams(rig.channel, "rig")
    bad = decode_pb2.DecodeGenerateRequest(request_id="bad", token_ids=[1, 2, 99999], params=P(max_tokens=2))
    gone = decode_pb2.DecodeGenerateRequest(reservation_id="no-such-reservation")
    good, refused, lost = await asyncio.gather(drain(streams, colocated(1, 4)), drain(streams, bad),
                                               drain(streams, gone))
    assert good[1] is None and good[0][-1].finish_reason
    e = refused[1]
    assert e is not None and e.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in e.details()
    assert detail_of(e).reason == Reason.ERROR_REASON_INVALID_INPUT and detail_of(e).field == "token_ids"
    e = lost[1]
    assert e is not None and e.code() == grpc.StatusCode.NOT_FOUND
    assert detail_of(e).reason == Reason.ERROR_REASON_RESERVATION_GONE and detail_of(e).retryable
    await streams.close()
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and rig.servicer.generating == 0


async def test_leaving_a_request_cancels_it_at_once_and_its_neighbours_run_on(decode_rig):
    rig = await decode_rig(mode="colocated")
    base = await idle(rig.engine)
    streams = DecodeStreams(rig.channel, "rig")
    long = colocated(1, 400, ignore_eos=True)
    async with contextlib.aclosing(streams.generate(long, timeout_s=60)) as g:
        first = await anext(g)
        assert first.token_ids
        neighbour = asyncio.ensure_future(drain(streams, colocated(2, 6)))
    # Left after one message: decode aborted it and freed its blocks while the neighbour finished.
    msgs, err = await neighbour
    assert err is None and msgs[-1].usage.completion_tokens == 6
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and rig.servicer.generating == 0
    await streams.close()


async def test_a_deadline_cancels_the_request_and_fails_it_deadline_exceeded(decode_rig):
    rig = await decode_rig(mode="colocated")
    base = await idle(rig.engine)
    streams = DecodeStreams(rig.channel, "rig")
    _msgs, err = await drain(streams, colocated(3, 4000, ignore_eos=True), timeout_s=0.5)
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and rig.servicer.generating == 0
    await streams.close()


async def test_the_stream_going_away_frees_every_request_on_it(decode_rig):
    rig = await decode_rig(mode="colocated")
    base = await idle(rig.engine)
    streams = DecodeStreams(rig.channel, "rig")
    runs = [asyncio.ensure_future(drain(streams, colocated(i, 4000, ignore_eos=True))) for i in range(4)]
    for _ in range(1200):  # every request admitted and running (bounded: 60 s)
        if rig.servicer.generating == 4 and (await rig.engine.stats())["running"] == 4:
            break
        await asyncio.sleep(0.05)
    await streams.close()  # the router's side went away (a router restart, the channel closed)
    for _msgs, err in await asyncio.gather(*runs):
        assert err is not None and err.code() == grpc.StatusCode.CANCELLED
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and rig.servicer.generating == 0


async def test_a_reserved_request_streams_its_kv_imported_tokens(decode_rig):
    rig = await decode_rig()
    base, ref, resv = await reserved(rig, PROMPT, 6)
    streams = DecodeStreams(rig.channel, "rig")
    assert (await push(rig.stub, chunks(resv, PROMPT, ref))).code == grpc.StatusCode.OK
    msgs, err = await drain(streams, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
    assert err is None and [t for m in msgs for t in m.token_ids] == ref.tokens
    assert msgs[-1].finish_reason in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP)
    assert msgs[-1].usage.completion_tokens == len(ref.tokens)
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0
    await streams.close()


async def test_a_reservation_ended_by_abort_fails_its_entry_cancelled(decode_rig):
    rig = await decode_rig()
    base, _ref, resv = await reserved(rig, PROMPT, 6)
    streams = DecodeStreams(rig.channel, "rig")
    run = asyncio.ensure_future(drain(streams, decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id)))
    for _ in range(3000):  # the stream has the reservation (bounded: 60 s)
        if rig.servicer.generating:
            break
        await asyncio.sleep(0.02)
    assert (await rig.stub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    _msgs, err = await run
    assert err is not None and err.code() == grpc.StatusCode.CANCELLED
    assert (await idle(rig.engine))["free_blocks"] == base["free_blocks"] and len(rig.servicer.table) == 0
    await streams.close()


async def test_a_reader_that_fell_behind_gets_what_was_queued_as_one_message_in_order(decode_rig):
    rig = await decode_rig(mode="colocated")
    req = colocated(7, 40, ignore_eos=True, logprobs=True, top_logprobs=2)
    alone, reason, out = await generate(rig.stub, req)
    assert out.code == grpc.StatusCode.OK and len(alone) == 40
    streams = DecodeStreams(rig.channel, "rig")
    msgs: list[common_pb2.GenerateResponse] = []
    async with contextlib.aclosing(streams.generate(req, timeout_s=60)) as g:
        msgs.append(await anext(g))
        for _ in range(200):  # fall behind until the request finished on decode
            if rig.servicer.generating == 0 and (await rig.engine.stats())["running"] == 0:
                break
            await asyncio.sleep(0.05)
        msgs += [m async for m in g]
    await streams.close()
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == alone
    assert len(msgs) < len(tokens)  # what was queued behind the reader came as one message
    assert len([lp for m in msgs for lp in m.logprobs]) == len([t for m in msgs for t in m.top_logprobs]) == 40
    assert [m.finish_reason for m in msgs[:-1]] == [0] * (len(msgs) - 1) and msgs[-1].finish_reason == reason
    assert msgs[-1].usage.completion_tokens == 40
