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
from services.engine.sampling_params import SamplingParams
from tests.prefill.test_mooncake_staging import _offer_landing
from tests.prefill.test_transports import ENGINE, PROMPTS, _generate, _idle, _request, _reserve, pair

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
    """Decode's claim answer comes 0.3 s late: every chunk is computed before it, the last one's groups are
    staged at once and sent only after the answer (the earlier chunks ride in the same write)."""
    from services.engine.kv_transport import grpc_stream

    made = _record_groups(monkeypatch)
    real = grpc_stream._GrpcSender.bootstrap
    answered: list[float] = []

    async def late(self, claim=None):
        await asyncio.sleep(0.3)
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
