"""Rank-to-rank pages at TP=2 on both sides (real processes, gloo, shm): decode's Reserve offers every rank's
pool; a claim for another reservation, or one naming a head split that is not decode's, is refused; a prefill
killed while its ranks write into decode's pools leaves every decode block free again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.kv_kinds import pool_id
from services.common.metrics import DECODE_KV_STREAMS_BROKEN_TOTAL, PREFILL_KV_RANK_PAGES_TOTAL
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.launcher import LocalCluster
from tests.e2e.cluster_util import load_sync, metric_sum, wait_idle
from tests.e2e.test_handoff_errors import _abort
from tests.e2e.test_tensor_parallel_pd import ENGINE, MODEL, _children, _cmdline, _generate

pytestmark = pytest.mark.e2e

PROMPT = [(3 * i + 1) % 250 for i in range(40)]  # 3 pages of 16
LONG_CHUNKS = 10
LONG = [(11 * i + 5) % 250 for i in range(32 * LONG_CHUNKS)]  # 20 pages: chunks of 32 tokens, >= 4 s in all
SLOWDOWN_MS = 400


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    tp2 = ["--tensor-parallel-size", "2"]
    extra = {"prefill": [*ENGINE, *tp2, "--max-prefill-chunk", "32", "--slowdown-ms-per-chunk", str(SLOWDOWN_MS)],
             "decode": [*ENGINE, *tp2]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=MODEL, dtype="float32", extra=extra, quiet=True,
                      kv_transport="shm") as c:
        yield c


async def _reserve(addr: str, ids: list[int]) -> decode_pb2.ReserveResponse:
    async with create_channel(addr) as ch:
        return await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
            request_id=f"t-{time.monotonic_ns()}", token_ids=ids, lease_ms=60_000,
            params=common_pb2.SamplingParams(max_tokens=4, temperature=0.0)), timeout=30)


def _claim(resv: decode_pb2.ReserveResponse, blocks: list[int], pool_tp: int) -> common_pb2.KVChunk:
    """A TP=2 writer's claim on ``resv`` naming ``blocks`` and a pool split over ``pool_tp`` ranks."""
    split = common_pb2.KVHeadSplit(tp_size=2, kv_heads_per_rank=1, replicas=1)
    pool = common_pb2.KVHeadSplit(tp_size=pool_tp, kv_heads_per_rank=2 // pool_tp, replicas=1)
    return common_pb2.KVChunk(
        reservation_id=resv.reservation_id, reservation_token=resv.reservation_token, transport="shm",
        claim=common_pb2.KVClaim(transport="shm", dest_block_ids=blocks, pool_id=pool_id(resv.destination),
                                 writer_split=split, pool_split=pool))


async def _push(addr: str, first: common_pb2.KVChunk) -> tuple[grpc.StatusCode, str]:
    async def gen():
        yield first

    async with create_channel(addr) as ch:
        try:
            await decode_pb2_grpc.DecodeStub(ch).PushKV(gen(), timeout=30)
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_decode_offers_every_rank_pool_and_refuses_foreign_claims(cluster: LocalCluster) -> None:
    addr = cluster.get("decode-0").ready["grpc"]
    a, b = asyncio.run(_reserve(addr, PROMPT)), asyncio.run(_reserve(addr, PROMPT[::-1]))
    sp = a.destination.sharded
    assert a.destination.WhichOneof("pool") == "sharded" and sp.tp_size == 2 and sp.num_kv_heads == 2
    assert [(r.rank, r.kv_head_start, r.kv_head_end, r.pool.WhichOneof("pool")) for r in sp.ranks] == [
        (0, 0, 1, "shm"), (1, 1, 2, "shm")]
    assert sp.ranks[0].pool.shm.name != sp.ranks[1].pool.shm.name  # each rank's own pool file
    # Reservation a's token naming reservation b's blocks: another reservation's pages, refused.
    code, msg = asyncio.run(_push(addr, _claim(a, list(b.block_ids), 2)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "dest_block_ids" in msg, (code, msg)
    # The right blocks but a pool split that is not decode's (the writer thinks one pool holds both heads).
    code, msg = asyncio.run(_push(addr, _claim(a, list(a.block_ids), 1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "tp1x2kvh" in msg and "tp2x1kvh" in msg, (code, msg)
    # The refusals changed nothing: both reservations are still held (their blocks are not free).
    rep = load_sync(addr)
    assert rep.total_blocks - rep.free_blocks >= len(a.block_ids) + len(b.block_ids), rep
    # A real request still goes through (rank to rank) while they are held.
    assert len(asyncio.run(_generate(cluster.router["grpc"], PROMPT))) == 6
    pm = cluster.get("prefill-0").ready["metrics"]
    assert all(metric_sum(pm, PREFILL_KV_RANK_PAGES_TOTAL, rank=str(r)) > 0 for r in (0, 1))
    assert all(asyncio.run(_abort(addr, r.reservation_id)) for r in (a, b))


def test_prefill_killed_mid_transfer_frees_every_decode_block(cluster: LocalCluster) -> None:
    """kill -9 of the TP=2 prefill (both ranks) while its ranks write into decode's pools: the request ends
    with an error and decode's blocks are all free again (its claimed stream broke), sooner than the lease.

    No step assumes a timing: the kill follows evidence that pages are moving (the prefill's per-rank page
    counter grew: a chunk landed on every rank) while at least LONG_CHUNKS - 1 slowed chunks remain (seconds,
    however slow this host is), and every wait after it is bounded generously (slow is not dead)."""
    addr = cluster.get("decode-0").ready["grpc"]
    base = wait_idle(addr)
    assert base.free_blocks == base.total_blocks, base
    prefill = cluster.get("prefill-0")
    pm = prefill.ready["metrics"]
    victims = [prefill.popen.pid, *(p for p in _children(prefill.popen.pid) if b"spawn_main" in _cmdline(p))]
    assert len(victims) == 2, victims  # rank 0 (the service) and its one spawned rank, found before the request
    pages_before = metric_sum(pm, PREFILL_KV_RANK_PAGES_TOTAL)
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["tokens"] = asyncio.run(_generate(cluster.router["grpc"], LONG))
        except grpc.aio.AioRpcError as e:
            out["code"] = e.code()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while metric_sum(pm, PREFILL_KV_RANK_PAGES_TOTAL) == pages_before:  # no chunk of LONG has landed yet
        assert t.is_alive() and time.monotonic() < deadline, ("no page of the request was written rank to rank", out)
        time.sleep(0.05)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive(), "the request did not end within 120 s of the prefill's death"
    assert "code" in out, out  # an error, not tokens
    rep = wait_idle(addr, timeout=20)  # under the 30 s lease (lease_ms); the broken-stream counter says why
    assert rep.free_blocks == base.free_blocks == rep.total_blocks and rep.waiting_for_kv == 0, rep
    assert metric_sum(cluster.get("decode-0").ready["metrics"], DECODE_KV_STREAMS_BROKEN_TOTAL) >= 1
