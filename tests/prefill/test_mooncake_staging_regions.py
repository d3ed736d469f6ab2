"""Mooncake through pinned host staging with pages of several regions (the target's latent or K/V, DeepSeek-V3.2's
index keys, a draft's KV), on CPU: host tensors stand in for the device pools. Each landing slot holds one whole
page of every region (kv_transport/mooncake_staged.py), the prefill's page export packs every region of a run into
its staging span, decode's import scatters each region into its pool: what lands is byte for byte what the grpc
stream lands, native or with the fp8-e4m3 target wire codec, and a landing whose regions are not the prefill's is
refused naming both. Unit cases drive StagedWriter -> HostLanding over loopback TCP; 1P1D cases run real
servicers, real gRPC, real TE with a tiny DeepSeek-V3.2 checkpoint (latent + index keys) and a tiny Llama with a
draft."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_layout import FP8_CODEC, PageLayout, fp8_index_row
from services.engine.kv_pages import KVPages, pages_of
from services.engine.kv_transport import KVPoll, mooncake, mooncake_staged
from services.engine.kv_transport.mooncake_staged import HostLanding, StagedWriter, StagingRing, check_landing
from services.engine.page_regions import pack_regions, unpack_regions
from services.engine.shared_kv import SharedKVAttachError
from services.text.sampling_params import SamplingParams
from tests.engine.test_index_region import BS, INDEX_DIM, LATENT, NB, L, _layout, _v32_regions
from tests.moe_checkpoints import write_tiny_moe
from tests.prefill.test_mooncake_staging import CLAIM_BEFORE_LAST_CHUNK_MS, _offer_landing
from tests.prefill.test_transports import ENGINE, PROMPTS, Pair, _generate, _idle, _request, _reserve, pair

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
__all__ = ["pair"]  # the fixture, shared with tests/prefill/test_transports.py

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PAGE = (L, 2, BS, 1, sum(LATENT) // 2)
"""The V3.2-shaped target page: two latent planes of one "head" per layer (test_index_region.py)."""


class _Open:
    """The state of a request's KV stream that stays open (the writer polls it before every write)."""

    @staticmethod
    def poll() -> KVPoll:
        return KVPoll.TRANSFERRING


def _pool(region) -> torch.Tensor:
    """The pool holding a page region (a KVRegion's cache, the index keys' uint8 pool)."""
    return region.cache if hasattr(region, "cache") else region.kv_cache


def _pages(regions: list) -> KVPages:
    """The engine's page API over a runner whose pages are ``regions`` (target first), as a V3.2 engine's are."""
    def write_pages(ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        unpack_regions(pages, regions, ids, codec)

    target = _pool(regions[0])
    return KVPages(SimpleNamespace(kv_cache=target, device=target.device, composite=len(regions) > 1,
                                   page_regions=regions, write_pages=write_pages))


def _layouts(n: int) -> tuple[PageLayout, PageLayout]:
    """(native, fp8-e4m3 target) layouts of the first ``n`` regions of _v32_regions (target, fp8 index keys, draft)."""
    native = _layout(FP8_CODEC)
    native = dataclasses.replace(native, regions=native.regions[:n])
    fp8 = PageLayout.for_model("v32", L, 1, sum(LATENT) // 2, BS, FP8_CODEC, latent=LATENT)
    return native, dataclasses.replace(fp8, regions=(fp8.regions[0], *native.regions[1:]))


@pytest.mark.parametrize("codec", [None, FP8_CODEC], ids=["native", "fp8"])
@pytest.mark.parametrize("n", [2, 3], ids=["latent+index", "latent+index+draft"])
@pytest.mark.parametrize("entry_bytes", [mooncake_staged.ENTRY_BYTES, 1000], ids=["entries", "odd-entries"])
def test_v32_pages_land_byte_identical_to_the_page_bytes(monkeypatch, codec: str | None, n: int,
                                                         entry_bytes: int) -> None:
    """Scattered destination blocks over two writes: each run's pages (every region) land as one range from the
    run's first slot and import into every region's pool exactly as the same page bytes from the grpc stream do
    (unpack_regions of pack_regions); slots and blocks outside the runs stay untouched."""
    monkeypatch.setattr(mooncake_staged, "ENTRY_BYTES", entry_bytes)  # 1000: runs split into odd-sized entries
    if entry_bytes == 1000:  # and every page exported as its own piece (entries straddle pieces)
        monkeypatch.setattr(mooncake_staged, "PIECE_BYTES", 1)
    native, fp8 = _layouts(n)
    layout = fp8 if codec else native
    src, dst, want = _v32_regions(21)[:n], _v32_regions(22, fill=False)[:n], _v32_regions(23, fill=False)[:n]
    regions = native.regions[1:]
    prefill, decode = mooncake.MooncakeEngine("127.0.0.1"), mooncake.MooncakeEngine("127.0.0.1")
    landing = HostLanding(decode, _pool(dst[0]), _pages(dst).import_pages, regions)
    landing.slots.zero_()  # pinned host memory starts uninitialised; zeros show what was written
    offered = landing.destination.mooncake
    assert list(offered.regions) == [f"{r.name}:{r.codec}" for r in native.regions]
    assert offered.slot_bytes == landing.slot_bytes == native.page_bytes and offered.pool_bytes == NB * native.page_bytes
    assert mooncake.check_pool(offered, "127.0.0.1:1") == (tuple(_pool(dst[0]).shape), torch.float32)
    assert landing.accepts(fp8) and not landing.accepts(native)
    assert not landing.accepts(dataclasses.replace(fp8, regions=fp8.regions[:1]))  # the slots' other regions

    src_ids, dest = [0, 1, 2, 3, 4], [4, 5, 0, 2, 3]  # runs [4, 5], [0] (first write), [2, 3] (second)
    writer = StagedWriter(prefill, StagingRing(prefill, 1 << 20), PAGE, torch.float32, _pages(src).export,
                          landing.destination, dest, regions)
    writer.sender = _Open()  # type: ignore[assignment]
    assert writer.slot_bytes == native.page_bytes
    assert writer.start_groups(0, src_ids[:1]) is None  # a page of several regions leaves whole, never by layer group
    if codec:
        assert writer.carry(fp8) and writer.page_bytes == fp8.page_bytes < native.page_bytes
    for first, ids in ((0, src_ids[:3]), (3, src_ids[3:])):
        handle = writer.write(first, ids)
        if entry_bytes > layout.page_bytes * len(ids):  # one entry per run of consecutive destination blocks
            assert len(handle.srcs) == (2 if first == 0 else 1)
        writer.wait(handle)
        landing.land(dest[first:first + len(ids)], layout)
    assert writer.ring._free == [(0, writer.ring.capacity)]

    unpack_regions(pack_regions(src, src_ids, codec), want, dest, codec)  # what the grpc stream lands
    for got, expect, s in zip(dst, want, src, strict=True):
        assert torch.equal(_pool(got), _pool(expect)), got.kind
        assert not _pool(got)[:, :, 1].any()  # block 1 was in no run
        if got.kind != "draft" and (codec is None or got.kind == "index"):  # exact: index keys are copied as stored
            assert torch.equal(_pool(got)[:, :, dest], _pool(s)[:, :, src_ids]), got.kind
    slots = landing.slots
    pages = pack_regions(src, src_ids, codec)
    for (a, b, m) in ((0, 4, 2), (2, 0, 1), (3, 2, 2)):  # each run's pages back to back from its first slot
        run = slots.view(-1)[b * landing.slot_bytes:(b + m) * landing.slot_bytes]
        assert torch.equal(run[:m * layout.page_bytes], pages[a:a + m].reshape(-1))
        assert not run[m * layout.page_bytes:].any()  # (fp8: the rest of the run's own slots, untouched)
    assert not slots[1].any()


def test_a_landing_whose_regions_differ_is_refused_naming_both() -> None:
    """A writer whose pages have other regions than decode's landing slots (another index-key codec, no draft, the
    target alone; or a target-only landing, as a decode offers for a model without other regions) writes nothing:
    SharedKVAttachError whose reason is the first region that differs and whose message names both pages."""
    decode = mooncake.MooncakeEngine("127.0.0.1")
    pool = torch.zeros(L, 2, NB, *PAGE[2:])
    fp8_index, fp32_index = _layout(FP8_CODEC), _layout("fp32")
    landing = HostLanding(decode, pool, lambda *a: None, fp8_index.regions[1:])
    theirs = "+".join(f"{r.name}:{r.codec}" for r in fp8_index.regions)
    assert theirs == (f"target:fp32+index[L{L} d{INDEX_DIM} r{fp8_index_row(INDEX_DIM)}]:fp8-e4m3"
                      "+draft[v32 L1 kvh2 d8]:fp8-e4m3")
    dest = landing.destination.mooncake
    assert check_landing(dest, PAGE, torch.float32, fp8_index.regions[1:]) == fp8_index.page_bytes
    for regions, reason in ((fp32_index.regions[1:], "index"), (fp8_index.regions[1:2], "draft"), ((), "index")):
        ours = "+".join(f"{r.name}:{r.codec}" for r in (fp8_index.regions[0], *regions))
        with pytest.raises(SharedKVAttachError) as e:
            StagedWriter(decode, None, PAGE, torch.float32, None, landing.destination, [0], regions)  # type: ignore[arg-type]
        assert e.value.reason == reason
        assert f"landing area holds pages of {theirs} ({fp8_index.page_bytes} bytes a slot)" in str(e.value)
        assert f"this prefill's pages are {ours} (" in str(e.value)
    plain = HostLanding(decode, pool, lambda *a: None).destination  # the target region alone
    assert list(plain.mooncake.regions) == ["target:fp32"]
    old = type(plain.mooncake)()
    old.CopyFrom(plain.mooncake)
    old.ClearField("regions")
    old.slot_bytes = 0  # a decode that names no regions: its slots hold the target alone
    for d in (plain.mooncake, old):
        assert check_landing(d, PAGE, torch.float32, ()) == fp8_index.regions[0].bytes_per_page
        with pytest.raises(SharedKVAttachError, match=r"landing area holds pages of target:fp32 \(\d+ bytes a slot\), "
                                                      r"this prefill's pages are target:fp32\+index\[") as e:
            check_landing(d, PAGE, torch.float32, fp8_index.regions[1:])
        assert e.value.reason == "index"
    bad = type(dest)()
    bad.CopyFrom(dest)
    bad.slot_bytes += 1  # slots that do not add up to the registered bytes
    with pytest.raises(SharedKVAttachError, match="slots of"):
        mooncake.check_pool(bad, "127.0.0.1:1")


# --- 1P1D: real servicers, engines and transfer engines ---


@pytest.fixture(scope="module")
def tiny_v32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    return write_tiny_moe(tmp_path_factory.mktemp("deepseek_v32"), "deepseek_v32")


def _v32(model: Path, index_codec: str) -> EngineConfig:
    return dataclasses.replace(ENGINE, model=str(model), index_kv_codec=index_codec)


def _fallbacks(p: Pair) -> float:
    """Side-transport fallbacks of the prefill, every transport and reason."""
    return sum(s.value for fam in p.registry.collect() for s in fam.samples
               if s.name == "pdserve_prefill_kv_transport_fallbacks_total")


async def _handoff(p: Pair, ids: list[int], codec: str) -> tuple[list[int], int, torch.Tensor, list[int]]:
    """One request through the pair in the wire ``codec``: (tokens, kv_bytes_sent, decode's pages of the prompt's
    full blocks as its page API exports them (every region), those blocks)."""
    p.prefill.config.kv_wire_codec = codec
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    resp = await p.pstub.Prefill(_request(p, resv, ids))
    tokens = await consume
    assert resp.num_chunks > 1  # chunked: several writes, imported in order
    full = list(resv.block_ids[:len(ids) // ENGINE.block_size])  # decode appends to the last one
    await _idle(p.decode.engine)
    return tokens, resp.kv_bytes_sent, pages_of(p.decode.engine.engine).export(full).wait().clone(), full


async def _staged_equals_grpc(pair, prefill_cfg: EngineConfig, decode_cfg: EngineConfig, codec: str,
                              want: list[list[int]] | None) -> tuple[Pair, HostLanding]:
    """Every prompt through a grpc pair and through a staged mooncake pair (decode's landing area offered): the
    same tokens (``want``'s when given), the same bytes in decode's pool, page for page; the landing slots hold
    those pages; no fallback, every byte counted under mooncake, every span and block given back."""
    ref = await pair("grpc", prefill_engine=prefill_cfg, decode_engine=decode_cfg)
    # 100 ms a chunk: decode acknowledges the writer's claim before the prompt's last chunk, so pages go chunk by
    # chunk (a claim answered after it, on a loaded host, makes one deferred write: designed, not this test's path)
    p = await pair("mooncake", CLAIM_BEFORE_LAST_CHUNK_MS, prefill_engine=prefill_cfg, decode_engine=decode_cfg)
    landing = _offer_landing(p)
    layout = p.prefill.engine.engine.fp8_layout if codec == FP8_CODEC else p.prefill.layout
    assert len(layout.regions) > 1
    assert list(landing.destination.mooncake.regions) == [f"{r.name}:{r.codec}" for r in p.decode.engine.engine.layout
                                                         .regions]
    assert landing.slot_bytes == p.decode.engine.engine.layout.page_bytes
    sent = 0
    for i, ids in enumerate(PROMPTS):
        want_tokens, want_bytes, want_pages, _ = await _handoff(ref, ids, codec)
        tokens, nbytes, pages, full = await _handoff(p, ids, codec)
        assert tokens == want_tokens
        if want is not None:
            assert tokens == want[i]
        assert torch.equal(pages, want_pages)  # every region of every page, bit for bit
        if codec != FP8_CODEC:  # the slots hold the pages exactly as the page API imports them
            assert torch.equal(landing.host[full], pages)
        assert nbytes == want_bytes == -(-len(ids) // ENGINE.block_size) * layout.page_bytes
        sent += nbytes
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == sent
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="grpc") == 0
    assert _fallbacks(p) == 0
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]  # the staged path carried them, span by span
    for eng in (p.decode.engine, p.prefill.engine):
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]
    return p, landing


@pytest.mark.parametrize(("codec", "index_codec"), [("native", "native"), ("native", FP8_CODEC), (FP8_CODEC, "native")],
                         ids=["native", "fp8-index-keys", "fp8-wire"])
async def test_v32_1p1d_through_a_landing_area(pair, tiny_v32: Path, codec: str, index_codec: str) -> None:
    """DeepSeek-V3.2 (latent + index keys) with decode's pool behind a landing area, as a GPU decode offers it: the
    in-process engine's greedy tokens (native codec), the grpc stream's pages byte for byte, no fallback."""
    cfg = _v32(tiny_v32, index_codec)
    want = None if codec == FP8_CODEC else LLMEngine(cfg).generate(PROMPTS, GREEDY)
    p, _ = await _staged_equals_grpc(pair, cfg, cfg, codec, want)
    assert [r.kind for r in p.prefill.layout.regions] == ["target", "index"]
    assert p.prefill.layout.region("index").codec == ("fp32" if index_codec == "native" else FP8_CODEC)


@pytest.mark.parametrize("codec", ["native", FP8_CODEC])
async def test_a_draft_region_travels_through_the_landing_area(pair, codec: str) -> None:
    """A speculating decode (draft layers:1, K = 3) behind a landing area: the draft region rides in each slot after
    the target's (in the draft codec, as on the grpc stream); greedy output equals plain decoding's (native)."""
    prefill = dataclasses.replace(ENGINE, draft_model="layers:1")
    decode = dataclasses.replace(prefill, spec_tokens=3)
    want = None if codec == FP8_CODEC else LLMEngine(ENGINE).generate(PROMPTS, GREEDY)
    p, _ = await _staged_equals_grpc(pair, prefill, decode, codec, want)
    assert [r.kind for r in p.prefill.layout.regions] == ["target", "draft"]


async def test_a_v32_landing_whose_index_codec_differs_is_refused_counted(pair, tiny_v32: Path, caplog) -> None:
    """Decode's landing slots hold fp8-e4m3 index keys, the prefill's pages pool-dtype ones: the prefill writes no
    byte into the landing area (no writer; a fallback of reason ``index``), logging both pages."""
    p = await pair("mooncake", CLAIM_BEFORE_LAST_CHUNK_MS, prefill_engine=_v32(tiny_v32, "native"),
                   decode_engine=_v32(tiny_v32, FP8_CODEC))
    landing = _offer_landing(p)
    landing.slots.zero_()
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    pages = pages_of(p.prefill.engine.engine)
    with caplog.at_level(logging.WARNING, logger="services.kv.planner"):
        writer = await p.prefill.direct.writer(_request(p, resv, ids), pages.pool, len(resv.block_ids), pages.export)
    assert writer is None
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="index") == 1
    assert _fallbacks(p) == 1
    assert "landing area holds pages of target:fp32+index[L2 d" in caplog.text and "]:fp8-e4m3 (" in caplog.text
    assert "this prefill's pages are target:fp32+index[L2 d" in caplog.text and "]:fp32 (" in caplog.text
    assert not landing.slots.any()
