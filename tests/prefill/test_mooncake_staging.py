"""Mooncake through pinned host staging (the path a GPU prefill and a GPU decode take), on CPU: host tensors
stand in for the device pools. Prefill exports each chunk's pages into its registered staging ring, the
Transfer Engine writes them over loopback TCP into decode's registered landing area, and decode's engine
thread imports them into its pool when the chunk's descriptor lands. Real servicers, real gRPC, real TE."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.common.kv_kinds import pool_id
from services.engine.engine import LLMEngine
from services.engine.kv_pages import pages_of
from services.engine.kv_transport import mooncake, mooncake_staged
from services.engine.kv_transport.base import TransferError
from services.engine.kv_transport.mooncake_staged import ALIGN, HostLanding, StagingRing
from services.kv.mooncake import MOONCAKE_STAGED
from services.text.sampling_params import SamplingParams
from tests.prefill import test_transports as transports
from tests.prefill.test_transports import ENGINE, PROMPTS, Pair, _generate, _idle, _request, _reserve, pair

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
__all__ = ["pair"]  # the fixture, shared with tests/prefill/test_transports.py


CLAIM_BEFORE_LAST_CHUNK_MS = 100
"""Prefill slowdown per chunk (ms) of the tests that check pages staged chunk by chunk: decode acknowledges the
writer's claim before a prompt's last chunk is computed. Without it a claim answered after the last chunk (a loaded
host: tiny chunks take ~2 ms) makes one deferred write of every page, which is designed but not the path tested."""


def _offer_landing(p: Pair) -> HostLanding:
    """Have the decode offer a host landing area in front of its pool (and its other regions' pools), as a GPU
    decode does: the staged connector's own offer."""
    engine = next(e for e in pages_of(p.decode.engine.engine).exporters if isinstance(e, mooncake.MooncakeEngine))
    pages = pages_of(p.decode.engine.engine)
    destination = MOONCAKE_STAGED.offer(pages, engine)
    landing = pages.exporters[-1]
    assert isinstance(landing, HostLanding) and landing.destination == destination
    p.decode.destination = landing.destination
    p.decode.receiver.pool_id = pool_id(landing.destination)
    p.decode.receiver.landing = landing
    return landing


@pytest.mark.parametrize(("entry_bytes", "piece_bytes"), [(mooncake_staged.ENTRY_BYTES, mooncake_staged.PIECE_BYTES),
                                                         (1000, mooncake_staged.PIECE_BYTES), (1000, 1)])
async def test_staged_pages_land_and_give_the_in_process_engines_tokens(pair, monkeypatch, entry_bytes: int,
                                                                        piece_bytes: int) -> None:
    monkeypatch.setattr(mooncake_staged, "ENTRY_BYTES", entry_bytes)  # 1000: runs split into odd-sized entries
    # 1: every page exported as its own piece, entries sent piece by piece (some straddle two pieces)
    monkeypatch.setattr(mooncake_staged, "PIECE_BYTES", piece_bytes)
    p = await pair("mooncake", CLAIM_BEFORE_LAST_CHUNK_MS)
    landing = _offer_landing(p)
    sent = 0
    pool = pages_of(p.decode.engine.engine).pool
    for ids in PROMPTS:
        resv = await _reserve(p, ids)
        assert resv.destination.mooncake.page_major
        consume = asyncio.create_task(_generate(p, resv))
        resp = await p.pstub.Prefill(_request(p, resv, ids))
        tokens = await consume
        assert tokens == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
        assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
        assert resp.num_chunks > 1  # chunked: several staged writes, imported in order
        full = resv.block_ids[:len(ids) // p.prefill.layout.block_size]  # decode appends to the last one
        assert torch.equal(landing.host[full], pool[:, :, full].permute(2, 0, 1, 3, 4, 5))  # landed, imported
        sent += resp.kv_bytes_sent
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == sent
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="grpc") == 0
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]  # every span given back
    for eng in (p.decode.engine, p.prefill.engine):
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]


async def test_a_staged_prompt_larger_than_the_ring_goes_by_grpc_counted(pair) -> None:
    p = await pair("mooncake")
    _offer_landing(p)
    p.prefill.direct.staging_bytes = p.prefill.layout.page_bytes  # one page: no prompt fits
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="staging") == 1
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == 0


def _staged(pair, made: list[Pair]):
    """The ``pair`` fixture, with the decode offering a host landing area (what a GPU decode offers)."""
    async def make(transport: str, slowdown_ms: int = 0) -> Pair:
        p = await pair(transport, slowdown_ms)
        _offer_landing(p)
        made.append(p)
        return p
    return make


FAULTS = pytest.mark.parametrize("case", [
    transports.test_a_prefill_gone_mid_transfer_keeps_the_reservation_then_abort_frees_it,
    transports.test_a_decode_gone_mid_transfer_fails_prefill_as_a_handoff_failure,
    transports.test_a_descriptor_for_another_reservation_is_refused,
], ids=["prefill-gone", "decode-gone", "other-reservation"])
"""The faults every transport is held to (tests/prefill/test_transports.py), as a parametrization."""


@FAULTS
async def test_staged_faults_end_as_the_direct_writes_do(pair, case) -> None:
    """The staged writer under the faults every transport is held to (tests/prefill/test_transports.py):
    blocks freed, a clear status; and a broken stream leaves no staging span taken."""
    made: list[Pair] = []
    await case(_staged(pair, made), "mooncake")
    ring = made[0].prefill.direct._ring
    for _ in range(200):  # the prefill's cleanup (quiesce) may finish after the caller saw the failure
        if ring is None or ring._free == [(0, ring.capacity)]:
            break
        await asyncio.sleep(0.05)
    assert ring is None or ring._free == [(0, ring.capacity)]


def test_staging_ring_first_fit_merges_and_refuses_what_cannot_fit() -> None:
    engine = mooncake.MooncakeEngine("127.0.0.1")
    ring = StagingRing(engine, 4 * ALIGN)
    a = ring.take(ALIGN)
    b = ring.take(ALIGN + 1)  # rounded up to two aligned pages
    c = ring.take(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN) and ring._free == []
    with pytest.raises(TransferError):  # full, and the writer's stream failed: no wait
        ring.take(ALIGN, give_up=lambda: True)
    assert ring.waits == 1
    ring.give(b, ALIGN + 1)
    ring.give(a, ALIGN)
    assert ring._free == [(0, 3 * ALIGN)]  # adjacent spans merged
    ring.give(c, ALIGN)
    assert ring._free == [(0, 4 * ALIGN)]
    with pytest.raises(TransferError) as e:
        ring.take(4 * ALIGN + 1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
