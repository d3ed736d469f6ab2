"""A streamed prompt's last chunk sent layer group by layer group while it computes (mooncake through host
staging), on CPU with the group path forced on (--kv-export-layer-group-cpu): the real prefill engine's forward
hands each layer group to a GroupWrite, which exports it into the staging ring and has the Transfer Engine
write it over loopback TCP into decode's landing area before the chunk's descriptor goes out. Real servicers,
real gRPC, real TE, real CPU engines."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import pytest
import torch

from services.common.grpc_util import Reason, detail_of
from services.common.pb import common_pb2
from services.engine.engine import LLMEngine
from services.engine.kv_pages import KVPages, pages_of
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.mooncake_groups import GroupWrite
from services.engine.kv_transport.mooncake_staged import StagedWriter
from services.text.sampling_params import SamplingParams
from tests.prefill.test_claim_overlap import HANG_GUARD, _hold_claims, _prompt_done
from tests.prefill.test_mooncake_staging import _offer_landing
from tests.prefill.test_transports import (
    ENGINE,
    PROMPTS,
    _assert_freed,
    _generate,
    _idle,
    _refused_unclaimed,
    _request,
    _request_into_other_blocks,
    _reserve,
    _until,
    pair,
)

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
__all__ = ["pair"]


def _grouped(size: int):
    return dataclasses.replace(ENGINE, kv_export_layer_group=size, kv_export_layer_group_cpu=True)


def _record_groups(monkeypatch) -> list[GroupWrite]:
    """Keep every GroupWrite the prefill's writers start (the real method runs)."""
    made: list[GroupWrite] = []
    real = StagedWriter.start_groups

    def start_groups(self, first_block: int, src_blocks: list[int], *wait) -> GroupWrite | None:
        g = real(self, first_block, src_blocks, *wait)
        if g is not None:
            made.append(g)
        return g

    monkeypatch.setattr(StagedWriter, "start_groups", start_groups)
    return made


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "unchunked"])
@pytest.mark.parametrize("size", [1, 3])
async def test_layer_groups_land_and_give_the_in_process_engines_tokens(pair, monkeypatch, size: int,
                                                                        chunked: bool) -> None:
    made = _record_groups(monkeypatch)
    p = await pair("mooncake", prefill_engine=_grouped(size))
    landing = _offer_landing(p)
    layers = p.prefill.engine.engine.runner.num_layers
    assert p.prefill.engine.engine.layer_group == size
    pool = pages_of(p.decode.engine.engine).pool
    for n, ids in enumerate(PROMPTS, 1):
        resv = await _reserve(p, ids)
        consume = asyncio.create_task(_generate(p, resv))
        resp = await p.pstub.Prefill(_request(p, resv, ids, chunked_transfer=chunked))
        tokens = await consume
        assert tokens == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
        assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
        assert len(made) == n  # the last chunk of each prompt went by layer group ...
        assert made[-1].groups_sent == -(-layers // size)  # ... every group of it
        if not chunked:  # the whole prompt's pages in that one write
            assert len(made[-1].src) == len(resv.block_ids)
        full = resv.block_ids[:len(ids) // p.prefill.layout.block_size]
        assert torch.equal(landing.host[full], pool[:, :, full].permute(2, 0, 1, 3, 4, 5))
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]  # every span given back
    for eng in (p.decode.engine, p.prefill.engine):
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]


async def test_the_group_path_stays_off_unless_forced_on_cpu(pair, monkeypatch) -> None:
    made = _record_groups(monkeypatch)
    p = await pair("mooncake")  # ENGINE: --kv-export-layer-group 4 (the default), not forced on CPU
    _offer_landing(p)
    assert p.prefill.engine.engine.layer_group == 0
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert made == []


async def test_an_export_failing_mid_groups_ends_the_request_and_frees_everything(pair, monkeypatch) -> None:
    made = _record_groups(monkeypatch)
    real = KVPages.export

    def export(self, block_ids, codec=None, out=None, layers=None):
        if layers is not None and layers[0] >= 1:  # the first group goes; the second fails
            raise RuntimeError("injected: device gone")
        return real(self, block_ids, codec, out, layers)

    monkeypatch.setattr(KVPages, "export", export)
    p = await pair("mooncake", prefill_engine=_grouped(1))
    _offer_landing(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.pstub.Prefill(_request(p, resv, ids))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert "export of layers [1, 2) failed" in e.value.details()
    # Nothing after the failure was sent: the first group went if decode's claim answer came before it.
    assert len(made) == 1 and made[0].groups_sent <= 1
    assert p.metric("pdserve_prefill_kv_transfer_failures_total", transport="mooncake", reason="internal") == 1
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]
    await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))  # what the router does
    with pytest.raises(grpc.aio.AioRpcError):
        await consume
    for eng in (p.decode.engine, p.prefill.engine):
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]


async def test_a_claim_answered_after_compute_began_is_waited_for_before_any_group_goes(pair, monkeypatch) -> None:
    """Decode's claim answer is held until the last chunk's group write has begun (so every chunk is computed
    before it, however loaded the box): the last chunk's groups are staged at once and sent only after the
    answer (the earlier chunks ride in the same write)."""
    from services.engine.kv_transport import grpc_stream

    made = _record_groups(monkeypatch)
    real = grpc_stream._GrpcSender.bootstrap
    answered: list[float] = []

    async def late(self, claim=None):
        await _until(lambda: len(made) == 1, HANG_GUARD)
        await asyncio.sleep(0.05)  # the write has staged its first group and waits on the answer
        await real(self, claim)
        answered.append(time.monotonic())

    monkeypatch.setattr(grpc_stream._GrpcSender, "bootstrap", late)
    p = await pair("mooncake", prefill_engine=_grouped(2))
    _offer_landing(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert len(made) == 1 and len(made[0].src) == len(resv.block_ids)  # the whole prompt in the last write
    assert made[0].groups_sent == -(-p.prefill.engine.engine.runner.num_layers // 2)
    assert made[0].first_sent is not None and made[0].first_sent >= answered[0]
    ring = p.prefill.direct._ring
    assert ring is not None and ring._free == [(0, ring.capacity)]


def _late_claims(monkeypatch, delay_s: float) -> list[float]:
    """Decode's claim answers reach the prefill ``delay_s`` late; returns when each came (monotonic seconds)."""
    from services.engine.kv_transport import grpc_stream

    real = grpc_stream._GrpcSender.bootstrap
    answered: list[float] = []

    async def late(self, claim=None):
        await asyncio.sleep(delay_s)
        await real(self, claim)
        answered.append(time.monotonic())

    monkeypatch.setattr(grpc_stream._GrpcSender, "bootstrap", late)
    return answered


def _ring_free(p) -> bool:
    ring = p.prefill.direct._ring
    return ring is not None and ring._free == [(0, ring.capacity)]


async def test_a_claim_unanswered_within_claim_wait_s_on_the_group_path_is_retryable(pair, monkeypatch) -> None:
    """The review's reproduction: groups of 2, --claim-wait-s 0.2, decode's claim answer 1.5 s late. Nothing
    was written and decode keeps the reservation: retryable (not KV_HANDOFF_FAILED), and the retry lands."""
    from services.engine.kv_transport import grpc_stream

    made = _record_groups(monkeypatch)
    real = grpc_stream._GrpcSender.bootstrap
    _late_claims(monkeypatch, 1.5)
    p = await pair("mooncake", prefill_engine=_grouped(2))
    _offer_landing(p)
    p.prefill.config.claim_wait_s = 0.2
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    err = await _refused_unclaimed(p, resv, ids)
    assert "did not acknowledge the KV claim within 0.2 s" in err.details()
    assert len(made) == 1 and made[0].groups_sent == 0  # the last chunk was armed by group; nothing went
    assert _ring_free(p)
    await _assert_freed(p.prefill.engine)
    r = p.decode.table.get(resv.reservation_id)
    await _until(lambda: not r.receiving, HANG_GUARD)
    assert r.end_cause is None and r.next_chunk == 0  # decode kept the reservation for a retry
    monkeypatch.setattr(grpc_stream._GrpcSender, "bootstrap", real)
    p.prefill.config.claim_wait_s = 60.0
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(_request(p, resv, ids))  # the retry the router makes, with the same reservation
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert len(made) == 2 and made[1].groups_sent == -(-p.prefill.engine.engine.runner.num_layers // 2)
    assert _ring_free(p)
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_claim_refused_after_the_groups_were_staged_sends_none(pair, monkeypatch) -> None:
    made = _record_groups(monkeypatch)
    p = await pair("mooncake", prefill_engine=_grouped(2))
    _offer_landing(p)
    gate = _hold_claims(p)
    ids, other_ids = PROMPTS
    resv, other, req = await _request_into_other_blocks(p, ids, other_ids)  # decode refuses the claim
    call = asyncio.ensure_future(p.pstub.Prefill(req))
    await _until(lambda: _prompt_done(p), HANG_GUARD)
    assert _prompt_done(p) and len(made) == 1  # every group staged, waiting for the answer
    gate.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED  # decode's answer
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert made[0].groups_sent == 0
    assert _ring_free(p)
    for x in (resv, other):
        assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=x.reservation_id))).found
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_prefill_cancelled_with_its_groups_staged_sends_none_and_frees_everything(pair, monkeypatch) -> None:
    """The caller leaves while the group write waits for the claim's answer: quiesce stops it (GroupWrite.stop),
    nothing is sent, the span and the blocks come back, decode keeps the reservation."""
    made = _record_groups(monkeypatch)
    p = await pair("mooncake", prefill_engine=_grouped(1))
    _offer_landing(p)
    gate = _hold_claims(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    call = asyncio.ensure_future(p.pstub.Prefill(_request(p, resv, ids)))
    await _until(lambda: _prompt_done(p), HANG_GUARD)
    assert _prompt_done(p) and len(made) == 1
    call.cancel()
    await _assert_freed(p.prefill.engine)
    await _until(lambda: _ring_free(p), HANG_GUARD)
    assert _ring_free(p) and made[0].groups_sent == 0
    gate.set()
    assert p.decode.table.get(resv.reservation_id).next_chunk == 0
    assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await _assert_freed(p.decode.engine)


async def test_a_send_failing_with_a_non_transfer_error_ends_the_request_and_frees_everything(pair, monkeypatch
                                                                                             ) -> None:
    """The worker thread fails with a RuntimeError: the write reports it as a TransferError (INTERNAL), so the
    cleanup's quiesce (GroupWrite.stop) does not raise midway and every block and span comes back."""
    made = _record_groups(monkeypatch)

    def submit(self, segments, srcs, dsts, lens):
        raise RuntimeError("injected: transfer engine gone")

    monkeypatch.setattr(mooncake.MooncakeEngine, "submit", submit)
    p = await pair("mooncake", prefill_engine=_grouped(2))
    _offer_landing(p)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    with pytest.raises(grpc.aio.AioRpcError) as e:  # unchunked: the only write is the group write
        await p.pstub.Prefill(_request(p, resv, ids, chunked_transfer=False))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert "sending the layer groups failed" in e.value.details()
    assert len(made) == 1 and made[0].groups_sent == 0
    assert _ring_free(p)
    await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    with pytest.raises(grpc.aio.AioRpcError):
        await consume
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_an_armed_write_never_taken_ends_with_its_stream() -> None:
    """A write armed for a last chunk whose step raised (``take`` never pops it) does not keep its stream (and
    so the entry) alive: the sink reaches the stream through a weak reference only."""
    import gc
    from types import SimpleNamespace

    from services.prefill.kv_stream import RequestKVStream
    from services.prefill.layer_export import LayerExports

    class Sink:  # what a GroupWrite keeps of its maker: the ``cleared`` callable, and its handle
        def __init__(self, cleared) -> None:
            self.cleared, self.handle = cleared, self

        def group_done(self, first_layer: int, end_layer: int) -> None: ...

        def abandon(self) -> None: ...

    class Writer:
        def start_groups(self, first_block, src_blocks, cleared, clear_wait_s):
            return Sink(cleared)

    loop = asyncio.get_running_loop()
    stream = RequestKVStream(loop, lambda ids: None, 16, 0, False, 0.0, writer=Writer(), claim_wait_s=1.0)
    stream.claim_task, stream.claim_ok = loop.create_future(), False  # a claim sent, not answered
    exports = LayerExports()
    exports.watch("r", stream)
    seq = SimpleNamespace(request_id="r", seq_id=1, num_computed_tokens=0, block_table=[3, 4])
    sink = exports(SimpleNamespace(sample=True, seq=seq, num_new_tokens=20))
    assert isinstance(sink, Sink) and len(exports._armed) == 1 and sink.cleared() is None
    stream.claim_task.cancel()
    del stream
    gc.collect()
    assert len(exports._armed) == 0 and sink.cleared() is False
