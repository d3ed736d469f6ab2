"""The fp8-e4m3 wire codec over Mooncake with host staging (the path GPU pools take), on CPU.

The codec is negotiated as for grpc (decode lists the fp8 layout's fingerprint at Reserve, the prefill is
configured for it) and named in the writer's claim: prefill quantizes each chunk's pages into its staging
ring, the Transfer Engine writes the fp8 bytes + scales into decode's landing area over loopback TCP, and
decode's engine thread dequantizes them into its pool. Real servicers, real gRPC, real TE."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.common.grpc_util import Reason, detail_of
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2
from services.engine.engine import LLMEngine
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_pages import PageExport, pages_of
from services.engine.kv_transport import CLAIM_ACK, KVPoll, mooncake
from services.engine.kv_transport.mooncake_staged import HostLanding, StagedWriter, StagingRing
from services.kernels import pack_pages_fp8, unpack_pages_fp8
from services.text.sampling_params import SamplingParams
from tests.prefill import test_mooncake_staging as staging
from tests.prefill.test_mooncake_staging import NO_MOONCAKE, _offer_landing
from tests.prefill.test_transports import ENGINE, PROMPTS, Pair, _generate, _idle, _request, _reserve, pair

pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
__all__ = ["pair"]  # the fixture, shared with tests/prefill/test_transports.py


async def _handoff(p: Pair, ids: list[int]) -> tuple[list[int], int, torch.Tensor]:
    """One request through the pair with the fp8 wire codec: (tokens, kv_bytes_sent, decode's pages of the
    prompt's full blocks [P, L, 2, bs, kvh, hd], read once the request finished)."""
    p.prefill.config.kv_wire_codec = FP8_CODEC
    resv = await _reserve(p, ids)
    assert p.decode.engine.engine.fp8_layout.fingerprint in resv.accepted_wire_fingerprints
    consume = asyncio.create_task(_generate(p, resv))
    resp = await p.pstub.Prefill(_request(p, resv, ids))
    tokens = await consume
    full = list(resv.block_ids[:len(ids) // ENGINE.block_size])  # decode appends to the last one
    return tokens, resp.kv_bytes_sent, pages_of(p.decode.engine.engine).pool[:, :, full].permute(2, 0, 1, 3, 4, 5)


def _reference_pages(ids: list[int]) -> torch.Tensor:
    """The in-process engine's KV of the prompt's full blocks, in the cache's dtype."""
    ref = LLMEngine(ENGINE)
    tables: list[list[int]] = []
    ref.chunk_listeners.append(lambda ch, _s: tables.append(list(ch.seq.block_table)))
    ref.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return ref.runner.read_pages(tables[-1][:len(ids) // ENGINE.block_size])


@pytest.mark.parametrize("entry_bytes", [staging.mooncake_staged.ENTRY_BYTES, 1000])
async def test_staged_fp8_equals_the_grpc_fp8_path_and_moves_the_fp8_bytes(pair, monkeypatch, entry_bytes: int
                                                                            ) -> None:
    monkeypatch.setattr(staging.mooncake_staged, "ENTRY_BYTES", entry_bytes)  # 1000: odd-sized entries
    monkeypatch.setattr(staging.mooncake_staged, "PIECE_BYTES", 1 if entry_bytes == 1000 else
                        staging.mooncake_staged.PIECE_BYTES)  # odd entries: also one fp8 page per export piece
    grpc_pair = await pair("grpc")
    p = await pair("mooncake")
    _offer_landing(p)
    fp8 = p.prefill.engine.engine.fp8_layout
    sent = 0
    for ids in PROMPTS:
        want_tokens, want_bytes, want_pages = await _handoff(grpc_pair, ids)
        tokens, nbytes, pages = await _handoff(p, ids)
        # Same quantization on both transports: the same pages bit for bit, hence the same tokens.
        assert tokens == want_tokens
        assert torch.equal(pages, want_pages)
        assert nbytes == want_bytes == -(-len(ids) // ENGINE.block_size) * fp8.page_bytes
        assert nbytes < -(-len(ids) // ENGINE.block_size) * p.prefill.layout.page_bytes // 3  # fp32 cache
        # Within fp8-e4m3 precision of the in-process engine's KV (the grpc fp8 tests' bound), and really coded.
        ref = _reference_pages(ids)
        amax = ref.abs().amax(dim=-1, keepdim=True)  # per (page, layer, K/V, token, head)
        assert ((pages - ref).abs() <= amax / 16 + 1e-6).all()
        assert not torch.equal(pages, ref)
        sent += nbytes
    # The bytes the Transfer Engine moved, under the transport that moved them.
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == sent
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="grpc") == 0
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]
    for eng in (p.decode.engine, p.prefill.engine):
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]


async def test_the_staging_fit_counts_the_negotiated_codecs_pages(pair) -> None:
    """A ring that holds a prompt's fp8 pages but not its native ones: fp8 goes by mooncake, native falls
    back to grpc (counted, reason staging)."""
    p = await pair("mooncake")
    _offer_landing(p)
    ids = PROMPTS[1]
    blocks = -(-len(ids) // ENGINE.block_size)
    ring = -(-blocks * p.prefill.engine.engine.fp8_layout.page_bytes // staging.ALIGN) * staging.ALIGN
    assert ring < blocks * p.prefill.layout.page_bytes
    p.prefill.direct.staging_bytes = ring
    tokens, nbytes, _ = await _handoff(p, ids)
    assert tokens  # (fp8 may sample the end token before max_tokens)
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == nbytes > 0
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="staging") == 0
    p.prefill.config.kv_wire_codec = "native"
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="staging") == 1


def _fp8_claim(p: Pair, resv) -> common_pb2.KVChunk:
    return common_pb2.KVChunk(
        request_id="r", reservation_id=resv.reservation_id, transport="mooncake",
        reservation_token=resv.reservation_token,
        claim=common_pb2.KVClaim(transport="mooncake", dest_block_ids=list(resv.block_ids),
                                 pool_id=pool_id(resv.destination), codec=common_pb2.KV_CODEC_FP8_E4M3))


@pytest.mark.parametrize("landing", [True, False], ids=["landing-without-fp8", "pool-itself"])
async def test_a_codec_decode_did_not_offer_is_refused_at_the_claim_and_frees_nothing(pair, landing: bool) -> None:
    """fp8 claimed on a landing area whose decode takes no fp8, or on a pool registered itself (which holds
    the cache's dtype only): refused before any write; the reservation is kept and still completes."""
    p = await pair("mooncake")
    if landing:
        _offer_landing(p)
        fp8 = p.decode.engine.engine.fp8_layout.fingerprint
        p.decode.receiver.layouts.pop(fp8)  # this decode no longer decodes fp8
    base = await _idle(p.decode.engine)
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    call = p.dstub.PushKV()
    await call.write(_fp8_claim(p, resv))
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    md = list(await call.initial_metadata() or ())
    assert not any(kv in md for kv in CLAIM_ACK)  # never acknowledged: nothing may have been written
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert detail_of(e.value).reason == Reason.ERROR_REASON_LAYOUT_MISMATCH
    assert "claim.codec" in e.value.details()
    r = p.decode.table.get(resv.reservation_id)
    assert r is not None and r.end_cause is None and not r.receiving and r.next_chunk == 0
    # The kept reservation takes the pages in the pool's own dtype and gives the in-process tokens.
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") > 0
    s = await _idle(p.decode.engine)
    assert s["free_blocks"] == base["free_blocks"] == s["total_blocks"]


async def test_a_descriptor_in_another_codec_than_the_claim_is_refused_and_frees_after_the_stream(pair) -> None:
    """A writer that claimed native pages cannot describe fp8 ones (nor the reverse): INVALID_ARGUMENT,
    LAYOUT_MISMATCH; a protocol violation ends the reservation, its blocks freed once the stream ends."""
    p = await pair("mooncake")
    _offer_landing(p)
    base = await _idle(p.decode.engine)
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    claim = _fp8_claim(p, resv)
    claim.claim.codec = common_pb2.KV_CODEC_NATIVE
    call = p.dstub.PushKV()
    await call.write(claim)
    md = list(await call.initial_metadata() or ())
    assert all(kv in md for kv in CLAIM_ACK)  # a native claim on the landing area is accepted
    await call.write(common_pb2.KVChunk(
        request_id="r", reservation_id=resv.reservation_id, chunk_index=0, first_block=0,
        num_pages=len(resv.block_ids), token_end=len(ids), transport="mooncake", is_last=True,
        layout_fingerprint=p.decode.engine.engine.fp8_layout.fingerprint, codec=common_pb2.KV_CODEC_FP8_E4M3,
        reservation_token=resv.reservation_token))
    await call.done_writing()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert detail_of(e.value).reason == Reason.ERROR_REASON_LAYOUT_MISMATCH
    assert "claim named" in e.value.details()
    assert p.decode.table.get(resv.reservation_id) is None
    s = await _idle(p.decode.engine)
    assert s["free_blocks"] == base["free_blocks"] == s["total_blocks"]


@staging.FAULTS
async def test_staged_fp8_faults_end_as_the_direct_writes_do(pair, case) -> None:
    """The fp8 staged writer under the faults every transport is held to: a clear status, block counts back
    to baseline (the case checks them), and no staging span left taken (the native staged test's checks)."""
    async def fp8_pair(transport: str, slowdown_ms: int = 0) -> Pair:
        p = await pair(transport, slowdown_ms)
        p.prefill.config.kv_wire_codec = FP8_CODEC
        return p

    await staging.test_staged_faults_end_as_the_direct_writes_do(fp8_pair, case)


class _Open:
    """The state of a request's KV stream that stays open (the writer polls it before every write)."""

    @staticmethod
    def poll() -> KVPoll:
        return KVPoll.TRANSFERRING


def test_fp8_runs_land_inside_their_own_slots_and_import_as_quantized() -> None:
    """Scattered destination blocks, two chunks: each run's fp8 pages land back to back from its first slot
    (the other slots stay untouched) and import dequantized into exactly those pool blocks."""
    shape = (2, 2, 4, 2, 16)  # layers, K|V, block_size, kv_heads, head_dim
    src = torch.randn(2, 2, 8, *shape[2:])
    pool = torch.zeros(2, 2, 12, *shape[2:])
    dest = [5, 6, 2, 9, 10, 11]
    layout = PageLayout.for_model("m", 2, 2, 16, 4, FP8_CODEC)
    prefill, decode = mooncake.MooncakeEngine("127.0.0.1"), mooncake.MooncakeEngine("127.0.0.1")

    def import_pages(ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        assert codec == FP8_CODEC
        unpack_pages_fp8(pages, pool, torch.tensor(ids))

    def export(ids: list[int], codec: str | None, out: torch.Tensor) -> PageExport:
        assert codec == FP8_CODEC
        return PageExport(out.copy_(pack_pages_fp8(src, torch.tensor(ids))))

    landing = HostLanding(decode, pool, import_pages)
    landing.host.zero_()  # pinned host memory starts uninitialised; zeros show what was written
    assert landing.accepts(layout)
    writer = StagedWriter(prefill, StagingRing(prefill, 1 << 20), shape, src.dtype, export, landing.destination, dest)
    writer.sender = _Open()  # type: ignore[assignment]
    assert writer.carry(layout) and writer.page_bytes == layout.page_bytes < writer.slot_bytes
    for first, ids in ((0, [0, 1, 2]), (3, [3, 4, 5])):
        writer.wait(writer.write(first, ids))
        landing.land(dest[first:first + len(ids)], layout)
    want = torch.zeros_like(pool)
    unpack_pages_fp8(pack_pages_fp8(src, torch.arange(6)), want, torch.tensor(dest))
    assert torch.equal(pool, want)
    # Runs [5, 6], [2], [9, 10, 11]: m fp8 pages from the run's first slot (here within that one slot).
    slots = landing.host.view(12, -1).view(torch.uint8)
    runs = {5: 2, 2: 1, 9: 3}
    assert 3 * layout.page_bytes <= slots.shape[1]
    for b in range(12):
        written = runs.get(b, 0) * layout.page_bytes
        assert slots[b, :written].any() and not slots[b, written:].any() if written else not slots[b].any()
