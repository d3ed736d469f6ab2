"""Hostile and broken input on decode and prefill RPCs: the right status, a clear message, nothing
leaked, and the service keeps serving."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Awaitable, Callable

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.e2e.cluster_util import load_sync, metric_sum, wait_idle

pytestmark = pytest.mark.e2e

PROMPT = list(range(100, 140))  # 40 tokens: 3 pages of 16


async def _reserve(addr: str, ids=PROMPT, lease_ms: int = 60_000, **params) -> decode_pb2.ReserveResponse:
    async with create_channel(addr) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
            request_id=f"t-{time.monotonic_ns()}", token_ids=ids, lease_ms=lease_ms,
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, **params)), timeout=30)


async def _status(addr: str, call: Callable[[grpc.aio.Channel], Awaitable[object]]) -> tuple[grpc.StatusCode, str]:
    """(code, details) of ``call`` on a fresh channel to ``addr``; (OK, "") when it succeeds."""
    async with create_channel(addr) as ch:
        try:
            await call(ch)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


async def _push(addr: str, chunks: list[common_pb2.KVChunk]) -> tuple[grpc.StatusCode, str]:
    async def gen():
        for c in chunks:
            yield c
    return await _status(addr, lambda ch: decode_pb2_grpc.DecodeStub(ch).PushKV(gen(), timeout=30))


def _reserve_status(addr: str, req: decode_pb2.ReserveRequest) -> tuple[grpc.StatusCode, str]:
    return asyncio.run(_status(addr, lambda ch: decode_pb2_grpc.DecodeStub(ch).Reserve(req, timeout=30)))


def _chunk(resv: decode_pb2.ReserveResponse, index: int, first: int, n: int, *, fp: str | None = None,
           payload: bytes | None = None, crc: int | None = None, last: bool = False,
           token: bytes | None = None) -> common_pb2.KVChunk:
    data = payload if payload is not None else bytes(n * resv.layout.page_bytes)
    c = common_pb2.KVChunk(reservation_id=resv.reservation_id, chunk_index=index, first_block=first, num_pages=n,
                           token_start=first * 16, token_end=min((first + n) * 16, len(PROMPT)),
                           layout_fingerprint=resv.layout.fingerprint if fp is None else fp, payload=data,
                           checksum=zlib.crc32(data) if crc is None else crc, transport="grpc", is_last=last,
                           reservation_token=resv.reservation_token if token is None else token)
    if last:
        c.total_chunks = index + 1
    return c


@pytest.fixture
def decode_addr(pd_cluster) -> str:
    return pd_cluster.get("decode-0").ready["grpc"]


def test_reserve_rejects_bad_requests(decode_addr):
    cases = [
        (decode_pb2.ReserveRequest(token_ids=PROMPT, params=common_pb2.SamplingParams(max_tokens=4)), "request_id"),
        (decode_pb2.ReserveRequest(request_id="x", params=common_pb2.SamplingParams(max_tokens=4)), "prompt"),
        (decode_pb2.ReserveRequest(request_id="x", token_ids=PROMPT, params=common_pb2.SamplingParams(max_tokens=0)),
         "max_tokens"),
        (decode_pb2.ReserveRequest(request_id="x", token_ids=PROMPT,
                                   params=common_pb2.SamplingParams(max_tokens=4, temperature=-2)), "temperature"),
        (decode_pb2.ReserveRequest(request_id="x", token_ids=[1] * 9000, params=common_pb2.SamplingParams(max_tokens=4)),
         "context"),
    ]
    for req, word in cases:
        code, details = _reserve_status(decode_addr, req)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and word in details, (word, code, details)
    # Longer than the whole KV pool (but inside the context): no room, not a malformed request.
    code, details = _reserve_status(decode_addr, decode_pb2.ReserveRequest(
        request_id="big", token_ids=[5] * 6000, params=common_pb2.SamplingParams(max_tokens=4)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "blocks" in details, details
    rep = wait_idle(decode_addr)
    assert rep.free_blocks == rep.total_blocks


@pytest.mark.parametrize("case", ["fingerprint", "size", "out_of_order", "duplicate", "checksum", "range",
                                  "early_end"])
def test_push_kv_rejects_broken_chunks_and_frees_the_reservation(decode_addr, case):
    resv = asyncio.run(_reserve(decode_addr))
    assert len(resv.block_ids) == 3
    good0 = _chunk(resv, 0, 0, 1)
    chunks, code, words = {
        "fingerprint": ([_chunk(resv, 0, 0, 1, fp="0123456789abcdef")], grpc.StatusCode.FAILED_PRECONDITION,
                        ["0123456789abcdef", resv.layout.fingerprint]),
        "size": ([_chunk(resv, 0, 0, 1, payload=b"\0" * 1000)], grpc.StatusCode.INVALID_ARGUMENT, ["1000 bytes"]),
        "out_of_order": ([_chunk(resv, 1, 0, 1)], grpc.StatusCode.INVALID_ARGUMENT, ["out-of-order", "expected 0"]),
        "duplicate": ([good0, _chunk(resv, 0, 1, 1)], grpc.StatusCode.INVALID_ARGUMENT, ["duplicate"]),
        "checksum": ([_chunk(resv, 0, 0, 1, crc=12345)], grpc.StatusCode.DATA_LOSS, ["checksum"]),
        "range": ([_chunk(resv, 0, 2, 5)], grpc.StatusCode.INVALID_ARGUMENT, ["outside"]),
        "early_end": ([good0, _chunk(resv, 1, 1, 0, last=True)], grpc.StatusCode.INVALID_ARGUMENT, ["never"]),
    }[case]
    got, details = asyncio.run(_push(decode_addr, chunks))
    assert got == code, (got, details)
    for w in words:
        assert w in details, details
    rep = wait_idle(decode_addr)
    assert rep.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0


def test_push_kv_unknown_reservation_and_generate_unknown(decode_addr):
    resv = decode_pb2.ReserveResponse(reservation_id="rsv-nope", layout=common_pb2.PageLayout(page_bytes=8))
    code, details = asyncio.run(_push(decode_addr, [_chunk(resv, 0, 0, 0)]))
    assert code == grpc.StatusCode.NOT_FOUND and "rsv-nope" in details

    async def gen():
        async with create_channel(decode_addr) as ch:
            try:
                async for _ in decode_pb2_grpc.DecodeStub(ch).Generate(
                        decode_pb2.DecodeGenerateRequest(reservation_id="rsv-nope"), timeout=10):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()
    code, details = asyncio.run(gen())
    assert code == grpc.StatusCode.NOT_FOUND and "rsv-nope" in details


def test_complete_handoff_by_hand_streams_tokens(decode_addr):
    """A well-formed handoff (zero KV, so the tokens are meaningless) is accepted and decodes."""
    resv = asyncio.run(_reserve(decode_addr))
    last = _chunk(resv, 1, 1, 2, last=True)
    last.first_token = 7
    code, _ = asyncio.run(_push(decode_addr, [_chunk(resv, 0, 0, 1), last]))
    assert code == grpc.StatusCode.OK

    async def gen():
        toks = []
        async with create_channel(decode_addr) as ch:
            async for m in decode_pb2_grpc.DecodeStub(ch).Generate(
                    decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id), timeout=30):
                toks += m.token_ids
                reason = m.finish_reason
        return toks, reason
    toks, reason = asyncio.run(gen())
    assert toks[0] == 7 and len(toks) == 4 and reason == common_pb2.FINISH_REASON_LENGTH


async def _abort(addr: str, reservation_id: str) -> bool:
    async with create_channel(addr) as ch:
        return (await decode_pb2_grpc.DecodeStub(ch).Abort(common_pb2.AbortRequest(request_id=reservation_id),
                                                          timeout=30)).found


def test_push_kv_without_the_reservation_token_changes_nothing(decode_addr):
    resv = asyncio.run(_reserve(decode_addr))
    for token in (b"", bytes(16)):
        code, details = asyncio.run(_push(decode_addr, [_chunk(resv, 0, 0, 1, token=token)]))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "reservation_token" in details, details
    assert load_sync(decode_addr).waiting_for_kv >= 1  # the reservation is still there
    assert asyncio.run(_abort(decode_addr, resv.reservation_id))
    rep = wait_idle(decode_addr)
    assert rep.free_blocks == rep.total_blocks


def _all_pages(resv: decode_pb2.ReserveResponse, first_token: int) -> list[common_pb2.KVChunk]:
    """The pages decode does not cache yet in one last chunk (zero KV: the tokens are meaningless)."""
    first = resv.num_cached_blocks
    last = _chunk(resv, 0, first, len(resv.block_ids) - first, last=True)
    last.first_token = first_token
    return [last]


def test_huge_first_token_is_refused_and_decode_keeps_serving(decode_addr):
    ids = list(range(200, 240))  # a prompt no other test caches
    resv = asyncio.run(_reserve(decode_addr, ids))
    code, details = asyncio.run(_push(decode_addr, _all_pages(resv, 2_000_000_000)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "first_token" in details, details
    rep = wait_idle(decode_addr)
    assert rep.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0
    # The engine loop is alive: a well-formed handoff decodes.
    resv = asyncio.run(_reserve(decode_addr, ids))
    assert asyncio.run(_push(decode_addr, _all_pages(resv, 7)))[0] == grpc.StatusCode.OK

    async def gen():
        async with create_channel(decode_addr) as ch:
            return [t async for m in decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id), timeout=30) for t in m.token_ids]
    toks = asyncio.run(gen())
    assert toks[0] == 7 and len(toks) == 4


def test_huge_lease_is_capped(decode_addr):
    resv = asyncio.run(_reserve(decode_addr, lease_ms=4294967295))
    assert resv.lease_expires_unix <= time.time() + 300 + 1  # --max-lease-ms defaults to 300 s
    assert asyncio.run(_abort(decode_addr, resv.reservation_id))
    rep = wait_idle(decode_addr)
    assert rep.free_blocks == rep.total_blocks


def test_lease_expiry_frees_blocks(pd_cluster):
    addr = pd_cluster.get("decode-1").ready["grpc"]
    metrics = pd_cluster.get("decode-1").ready["metrics"]
    before = metric_sum(metrics, "pdserve_decode_reservations_expired_total")
    asyncio.run(_reserve(addr, lease_ms=300))
    assert load_sync(addr).waiting_for_kv == 1
    time.sleep(1.0)
    rep = wait_idle(addr)
    assert rep.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0
    assert metric_sum(metrics, "pdserve_decode_reservations_expired_total") == before + 1


def test_prefill_rejects_bad_requests(pd_cluster):
    prefill = pd_cluster.get("prefill-1").ready["grpc"]
    decode = pd_cluster.get("decode-0").ready["grpc"]

    base = dict(request_id="p", token_ids=PROMPT, decode_address=decode, reservation_id="rsv-x",
                reservation_token=bytes(16), params=common_pb2.SamplingParams(max_tokens=4))
    cases = [
        (prefill_pb2.PrefillRequest(**{**base, "decode_address": ""}), grpc.StatusCode.INVALID_ARGUMENT,
         "decode_address"),
        (prefill_pb2.PrefillRequest(**base, expected_layout_fingerprint="feedfacefeedface"),
         grpc.StatusCode.FAILED_PRECONDITION, "feedfacefeedface"),
        (prefill_pb2.PrefillRequest(**{**base, "params": common_pb2.SamplingParams(max_tokens=4, top_p=2.0)}),
         grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (prefill_pb2.PrefillRequest(**{**base, "token_ids": []}), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        # The decode does not know this reservation: the handoff fails and says so.
        (prefill_pb2.PrefillRequest(**base), grpc.StatusCode.NOT_FOUND, "rsv-x"),
        # Nobody listens there.
        (prefill_pb2.PrefillRequest(**{**base, "decode_address": "127.0.0.1:1"}), grpc.StatusCode.UNAVAILABLE,
         "KV handoff"),
    ]
    for req, code, word in cases:
        got, details = asyncio.run(_status(prefill, lambda ch, r=req: prefill_pb2_grpc.PrefillStub(ch).Prefill(
            r, timeout=60)))
        assert got == code and word in details, (word, got, details)
    rep = wait_idle(prefill)
    assert rep.running == rep.waiting == 0 and rep.free_blocks == rep.total_blocks
