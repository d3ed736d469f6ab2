"""The engine's page API (services/engine/kv_pages.py): export gathers exactly the requested pages, import
puts them back; on GPU the export runs on a side stream that later work on the compute stream cannot
overtake (a block reused right after its export still exports its old contents)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.pb import common_pb2
from services.engine.kv_pages import KVPages

SHAPE = (3, 2, 12, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]


def _runner(cache: torch.Tensor) -> SimpleNamespace:
    def write_pages(block_ids, pages, codec=None):
        from services.kernels import unpack_pages

        unpack_pages(pages.to(cache.device), cache, torch.tensor(block_ids, dtype=torch.int64, device=cache.device))

    return SimpleNamespace(kv_cache=cache, device=cache.device, kv_destination=None, num_layers=SHAPE[0],
                           block_size=SHAPE[3], num_kv_heads=SHAPE[4], head_dim=SHAPE[5], dtype=cache.dtype, spec=None,
                           index_keys=None, composite=False,
                           write_pages=write_pages)


def _expected(cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return torch.stack([cache[:, :, b] for b in ids]).cpu()


def test_export_then_import_moves_exactly_the_pages() -> None:
    src = torch.randn(SHAPE)
    pages = KVPages(_runner(src))
    ids = [5, 6, 7, 1, 9]
    got = pages.export(ids).wait()
    assert got.shape == (len(ids), SHAPE[0], 2, *SHAPE[3:])
    assert torch.equal(got, _expected(src, ids))
    dst = torch.zeros(SHAPE)
    KVPages(_runner(dst)).import_pages([0, 2, 3, 4, 11], got)
    for a, b in zip(ids, [0, 2, 3, 4, 11], strict=True):
        assert torch.equal(dst[:, :, b], src[:, :, a])
    assert pages.page_shape == (SHAPE[0], 2, *SHAPE[3:]) and pages.dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_export_is_ordered_before_later_compute_that_reuses_the_blocks() -> None:
    cache = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    pages = KVPages(_runner(cache))
    ids = [2, 3, 4, 10]
    want = _expected(cache, ids)
    torch.cuda._sleep(50_000_000)  # the "step" is still running on the compute stream when export is called
    exp = pages.export(ids)
    assert exp.done is not None and exp.host.is_pinned()
    cache[:, :, ids] = 0  # the next step reuses the blocks: it must run after the gather
    got = exp.wait()
    assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert not cache[:, :, ids].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_back_to_back_exports_into_one_staging_buffer_each_get_their_pages() -> None:
    """Gathers and host copies run on separate side streams (a gather never queues behind an earlier copy):
    two exports issued while the step still runs, then the blocks reused, each land their own old pages."""
    cache = torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16)
    pages = KVPages(_runner(cache))
    out = torch.empty((8, SHAPE[0], 2, *SHAPE[3:]), dtype=cache.dtype, pin_memory=True)
    first, second = [1, 2, 3], [7, 8]
    want_first, want_second = _expected(cache, first), _expected(cache, second)
    torch.cuda._sleep(50_000_000)
    a = pages.export(first, out=out[:3])
    b = pages.export(second, out=out[3:5])
    cache[:, :, first + second] = 0
    assert torch.equal(b.wait(), want_second) and torch.equal(a.wait(), want_first)
    assert out[:5].data_ptr() == a.host.data_ptr()  # written in place: the staging view, no copy of it


def _region_pages(device: str) -> tuple[SimpleNamespace, list]:
    """A runner whose pages carry DeepSeek-V3.2-style index keys beside the target (bf16 keys, 8 per token)."""
    from services.engine.index_keys import IndexKeys
    from services.engine.page_regions import KVRegion

    cache = torch.randn(SHAPE, device=device, dtype=torch.bfloat16)
    pool = torch.randint(0, 256, IndexKeys.pool_shape(SHAPE[0], SHAPE[2], SHAPE[3], 8, "bf16", torch.bfloat16),
                         dtype=torch.uint8, device=device)
    regions = [KVRegion("target", cache), IndexKeys(SHAPE[0], SHAPE[2], SHAPE[3], 8, "bf16", torch.bfloat16, pool)]
    runner = _runner(cache)
    runner.composite, runner.page_regions = True, regions
    return runner, regions


@pytest.mark.parametrize("codec", [None, "fp8-e4m3"])
def test_pages_of_several_regions_export_straight_into_a_staging_view(codec: str | None) -> None:
    """Every region of each page, back to back as page_regions packs them, written in place into ``out`` (a
    staging view, as the Mooncake staged writer hands it), in the target's wire codec."""
    from services.engine.page_regions import pack_regions

    runner, regions = _region_pages("cpu")
    pages = KVPages(runner)
    ids = [5, 6, 7, 1, 9]
    want = pack_regions(regions, ids, codec)
    assert want.shape[1] == regions[0].nbytes(codec) + regions[1].nbytes()
    out = torch.zeros(8, want.shape[1], dtype=torch.uint8)
    got = pages.export(ids, codec, out[2:7])
    assert got.host.data_ptr() == out[2:7].data_ptr()  # written in place: no copy of it
    assert torch.equal(out[2:7], want) and not out[:2].any() and not out[7:].any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_export_of_several_regions_is_on_the_side_streams_and_ordered_before_reuse() -> None:
    """Pages with index keys beside the target take the target-only page's side streams: the export is only queued
    (a pinned host copy with its event) and later compute that reuses the blocks cannot overtake it."""
    from services.engine.page_regions import pack_regions

    runner, regions = _region_pages("cuda")
    pages = KVPages(runner)
    ids = [2, 3, 4, 10]
    want = pack_regions(regions, ids, None).cpu()
    torch.cuda._sleep(50_000_000)  # the "step" is still running on the compute stream when export is called
    exp = pages.export(ids)
    assert exp.done is not None and exp.host.is_pinned()
    regions[0].cache[:, :, ids] = 0  # the next step reuses the blocks: it must run after the gather
    regions[1].kv_cache[:, :, ids] = 0
    assert torch.equal(exp.wait(), want)
    torch.cuda.synchronize()
    assert not regions[0].cache[:, :, ids].any() and not regions[1].kv_cache[:, :, ids].any()


class _Recorder:
    """A KVSender stand-in that keeps what pump hands it."""

    def __init__(self) -> None:
        self.sent: list[tuple[object, bytes, bytes | None]] = []

    async def send(self, chunk, payload=b"", wire=None) -> None:  # type: ignore[no-untyped-def]
        self.sent.append((chunk, bytes(payload), wire))


@pytest.mark.parametrize("codec", [None, "fp8-e4m3"])
def test_export_messages_gathers_each_piece_straight_into_the_message_that_carries_it(codec: str | None) -> None:
    from services.engine.kv_layout import FP8_CODEC
    from services.engine.kv_transport.grpc_wire import parse_chunk

    codec = FP8_CODEC if codec else None
    cache = torch.randn(SHAPE)
    pages = KVPages(_runner(cache))
    assert pages.exports_messages
    ids = [5, 6, 7, 1, 9]
    want = pages.export(ids, codec).wait().contiguous().view(torch.uint8).view(len(ids), -1)
    page_nbytes = want.shape[1]
    got = pages.export_messages(ids, codec, 2, 128, page_nbytes)
    assert [n for n, _ in got.pieces] == [2, 2, 1]
    first = 0
    for k, (n, buf) in enumerate(got.pieces):
        assert bytes(buf.payload) == want[first:first + n].numpy().tobytes()
        header = common_pb2.KVChunk(request_id="r", chunk_index=k, num_pages=n, first_block=first)
        wire = buf.seal(header)
        assert type(wire) is bytes and len(wire) == 128 + n * page_nbytes
        parsed = parse_chunk(wire)
        assert not parsed.error and parsed.header.num_pages == n and parsed.header.first_block == first
        assert bytes(parsed.payload) == want[first:first + n].numpy().tobytes()
        first += n


def test_pump_sends_cpu_pages_inside_the_messages_they_were_gathered_into() -> None:
    """The servicer's CPU byte-stream export: every page-carrying message reaches the sender already laid out
    (``wire``), with the header pump built (checksum included) and the pool's pages; nothing else is copied."""
    import asyncio
    from types import SimpleNamespace as NS

    from services.engine.kv_layout import PageLayout, checksum
    from services.engine.kv_transport.grpc_wire import parse_chunk
    from services.prefill.kv_stream import RequestKVStream, header_room, message_export, pump

    cache = torch.randn(SHAPE)
    pages = KVPages(_runner(cache))
    layout = PageLayout.for_model("m", SHAPE[0], SHAPE[4], SHAPE[5], SHAPE[3], "fp32")
    room = header_room("req-1", "rsv-1", b"t" * 32, layout, "grpc", 5)
    blocks = [3, 4, 5, 8, 9, 10, 11]
    page_nbytes = layout.page_bytes

    async def go() -> list[tuple[object, bytes, bytes | None]]:
        stream = RequestKVStream(asyncio.get_running_loop(), message_export(pages, layout, None, 2 * page_nbytes, room),
                                 SHAPE[3], 0, True, 0.0)
        seq = NS(num_computed_tokens=0, num_cached_tokens=0, block_table=blocks, request_id="req-1/x")
        top = NS(token_ids=[1, 2, 3, 4, 5], logprobs=[-0.1, -0.2, -0.3, -0.4, -0.5])

        def engine_thread() -> None:
            stream.on_chunk(NS(seq=seq, num_new_tokens=3 * SHAPE[3], sample=False), None, 0.0)
            seq.num_computed_tokens = 3 * SHAPE[3]
            stream.on_chunk(NS(seq=seq, num_new_tokens=4 * SHAPE[3] - 1, sample=True),
                            NS(token=7, logprob=-0.5, top=top), 0.0)

        rec = _Recorder()
        await asyncio.to_thread(engine_thread)
        await pump(stream, rec, "req-1", "rsv-1", b"t" * 32, layout, 2 * page_nbytes, "grpc")  # type: ignore[arg-type]
        return rec.sent

    sent = asyncio.run(go())
    assert [c.num_pages for c, _, _ in sent] == [2, 1, 2, 2]  # a chunk's pages in messages of at most 2
    for chunk, payload, wire in sent:
        assert wire is not None and len(wire) == room + len(payload)
        parsed = parse_chunk(wire)
        assert not parsed.error and bytes(parsed.payload) == payload
        assert parsed.header.checksum == checksum(payload) != 0
        assert not any(parsed.header.padding)
        parsed.header.ClearField("padding")
        assert parsed.header == chunk  # the header pump built, as decode parses it
        ids = blocks[chunk.first_block:chunk.first_block + chunk.num_pages]
        assert payload == _expected(cache, ids).numpy().tobytes()
    last = parse_chunk(sent[-1][2]).header
    assert last.is_last and last.first_token == 7 and list(last.first_top_logprobs.token_ids) == [1, 2, 3, 4, 5]
