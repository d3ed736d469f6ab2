"""Early prefill in a real 1P2D cluster (separate processes, the real model, grpc KV): a Reserve
refused by a full decode and retried on the other writes only there; every decode full cancels the early
Prefill (the client gets 429 with Retry-After) and prefill's blocks come back to baseline; an attach that
comes long after the prompt was computed still gives the engine's tokens. A decode is made full for real:
``--max-pending 1`` and one reservation held by the test."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.common import metrics as m
from services.common.grpc_util import create_channel
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import metric_sum, post_json, wait_idle
from tests.e2e.test_pd_cluster import _chat_ids, _reference, _router_generate

pytestmark = pytest.mark.e2e

SIZES = ["--kv-cache-bytes", str(96 << 20)]
FULL_MEMORY_S = 1.2
"""Longer than the router's DECODE_FULL_MEMORY_S and decode's --overload-retry-after-ms: early is on again."""


@pytest.fixture(scope="module")
def cluster():
    extra = {"prefill": SIZES, "decode": [*SIZES, "--max-pending", "1", "--overload-retry-after-ms", "500"],
             # load polls far apart: the router learns that a decode is full from its Reserve answer
             "router": ["--policy", "round_robin", "--health-interval-s", "60", "--dead-after-s", "600"]}
    with LocalCluster(prefill=1, decode=2, kvstore=None, dtype="float32", extra=extra, quiet=True,
                      kv_transport="grpc") as c:
        yield c


async def _hold(addr: str, ids: list[int]) -> decode_pb2.ReserveResponse:
    """A reservation nobody fills: with --max-pending 1 the decode answers every other Reserve OVERLOADED."""
    async with create_channel(addr) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
            request_id=f"hold-{time.monotonic_ns()}", token_ids=ids, lease_ms=120_000,
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)


async def _release(addr: str, resv: decode_pb2.ReserveResponse) -> None:
    async with create_channel(addr) as ch:
        await decode_pb2_grpc.DecodeStub(ch).Abort(common_pb2.AbortRequest(request_id=resv.reservation_id),
                                                     timeout=30)


def _attached(c: LocalCluster) -> float:
    return metric_sum(c.get("prefill-0").ready["metrics"], m.PREFILL_HANDOFF_PHASE_SECONDS + "_count",
                      phase="attached")


def _prefill_sent(c: LocalCluster) -> float:
    """Prefill calls the router sent (observed before each goes out)."""
    return metric_sum(c.router["metrics"], m.ROUTER_HANDOFF_PHASE_SECONDS + "_count", phase="prefill_sent")


def test_a_reserve_retried_on_another_decode_writes_only_there(cluster, reference_engine) -> None:
    c = cluster
    d0, d1 = (c.get(f"decode-{i}").ready for i in (0, 1))
    ids = _chat_ids(reference_engine, "Name three rivers and the seas they reach.")
    held = asyncio.run(_hold(d0["grpc"], ids))
    try:
        before = metric_sum(d0["metrics"], m.DECODE_KV_RECEIVED_BYTES_TOTAL)
        retried = 0.0
        for _ in range(4):  # round robin: some request tries decode-0 first (early: FULL_MEMORY_S apart)
            time.sleep(FULL_MEMORY_S)
            attached = _attached(c)
            got = asyncio.run(_router_generate(c.router["grpc"], ids))
            assert list(got.token_ids) == _reference(reference_engine, ids)
            assert _attached(c) == attached + 1  # it went out early
            retried = metric_sum(c.router["metrics"], m.ROUTER_DISPATCH_RETRIES_TOTAL, role="decode",
                                 reason="overloaded")
            if retried:
                break
        assert retried >= 1
        assert metric_sum(d0["metrics"], m.DECODE_KV_RECEIVED_BYTES_TOTAL) == before  # nothing went to decode-0
        assert metric_sum(d1["metrics"], m.DECODE_KV_RECEIVED_BYTES_TOTAL) > 0
    finally:
        asyncio.run(_release(d0["grpc"], held))


def test_every_decode_full_cancels_the_early_prefill_and_frees_its_blocks(cluster, reference_engine) -> None:
    c = cluster
    decodes = [c.get(f"decode-{i}").ready["grpc"] for i in (0, 1)]
    pm = c.get("prefill-0").ready["metrics"]
    ids = _chat_ids(reference_engine, "Describe a lighthouse at night in detail, " * 6)
    held = [asyncio.run(_hold(a, ids)) for a in decodes]
    try:
        time.sleep(FULL_MEMORY_S)
        cancelled = metric_sum(pm, m.PREFILL_REQUESTS_ABORTED_TOTAL, reason="cancelled")
        sent = _prefill_sent(c)
        body = {"model": served_model(c.router["http"]), "prompt": ids, "max_tokens": 4}
        status, reply = post_json(c.router["http"], "/v1/completions", body)
        assert status == 429, reply
        assert reply["error"]["message"]
        # At once, within DECODE_FULL_MEMORY_S of that OVERLOADED, the router sends no Prefill early: none at all.
        # The router observes prefill_sent before a Prefill goes out, so before either 429 is answered.
        status, _ = post_json(c.router["http"], "/v1/completions", body)
        assert status == 429
        assert _prefill_sent(c) == sent + 1
        deadline = time.monotonic() + 20
        while metric_sum(pm, m.PREFILL_REQUESTS_ABORTED_TOTAL, reason="cancelled") == cancelled:
            assert time.monotonic() < deadline, "the early Prefill was not cancelled"
            time.sleep(0.1)
        rep = wait_idle(c.get("prefill-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks, rep
    finally:
        for a, r in zip(decodes, held, strict=True):
            asyncio.run(_release(a, r))


def test_an_attach_long_after_the_prompt_was_computed_gives_the_engines_tokens(cluster, reference_engine) -> None:
    c = cluster
    prefill, decode = c.get("prefill-0").ready["grpc"], c.get("decode-0").ready["grpc"]
    ids = _chat_ids(reference_engine, "What makes a bridge stand up?")

    async def run() -> list[int]:
        async with create_channel(prefill) as pch, create_channel(decode) as dch:
            pstub, dstub = prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch)
            params = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
            call = pstub.Prefill(prefill_pb2.PrefillRequest(request_id="late", token_ids=ids, params=params,
                                                            attach_id="late-1"), timeout=120)
            await asyncio.sleep(3.0)  # the prompt computes meanwhile; its blocks are held, nothing is sent
            resv = await dstub.Reserve(decode_pb2.ReserveRequest(request_id="late", token_ids=ids, params=params,
                                                                 lease_ms=60_000), timeout=30)
            tokens: list[int] = []

            async def consume() -> None:
                async for msg in dstub.Generate(decode_pb2.DecodeGenerateRequest(
                        reservation_id=resv.reservation_id), timeout=120):
                    tokens.extend(msg.token_ids)

            consumer = asyncio.create_task(consume())
            att = prefill_pb2.AttachReservationRequest(
                request_id="late", attach_id="late-1", decode_address=decode, reservation_id=resv.reservation_id,
                num_skip_blocks=resv.num_cached_blocks, expected_layout_fingerprint=resv.layout.fingerprint,
                dest_block_ids=resv.block_ids, reservation_token=resv.reservation_token,
                accepted_wire_fingerprints=resv.accepted_wire_fingerprints)
            att.destination.CopyFrom(resv.destination)
            await pstub.AttachReservation(att, timeout=30)
            await call
            await consumer
            return tokens

    assert asyncio.run(run()) == _reference(reference_engine, ids, 8)
    for name in ("prefill-0", "decode-0"):
        rep = wait_idle(c.get(name).ready["grpc"])
        assert rep.free_blocks == rep.total_blocks, (name, rep)
