"""Prefill -> decode handoff through the fake transport (in-process), with fault injection.

Real servicers and engines (random tiny Llama, fp32) on a real grpc.aio server; only the KV bytes
travel through FakeTransport instead of the PushKV stream."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from services.common.grpc_util import Reason, detail_of
from services.common.metrics import DecodeMetrics, PrefillMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_transport import FakeTransport
from services.engine.kv_transport.fake import Faults
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.text.sampling_params import SamplingParams
from tests.grpc_server import loopback_server

PROMPT = [(i * 37) % 250 + 1 for i in range(45)]  # 45 tokens: 3 pages of 16, the last partial


def _ecfg() -> EngineConfig:
    return EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=64, max_prefill_chunk=7)


@contextlib.asynccontextmanager
async def _servers(decode_engine: EngineConfig, prefill_config: PrefillConfig, registry: CollectorRegistry):
    """(decode, prefill, faults, decode stub, prefill stub): both servicers on one grpc.aio server, the KV
    through FakeTransport; engines shut down on exit."""
    faults = Faults()
    decode = DecodeServicer(DecodeConfig(), DecodeMetrics(CollectorRegistry()), asyncio.Event())
    decode.bind(AsyncEngine(decode_engine))
    transport = FakeTransport({"decode-x": decode.receiver}, faults)
    prefill = PrefillServicer(prefill_config, PrefillMetrics(registry), transport, asyncio.Event())
    prefill.bind(AsyncEngine(_ecfg()))
    def add(server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
        prefill_pb2_grpc.add_PrefillServicer_to_server(prefill, server)

    server, address = await loopback_server(add)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield (decode, prefill, faults, decode_pb2_grpc.DecodeStub(channel),
                   prefill_pb2_grpc.PrefillStub(channel))
    finally:
        await server.stop(None)
        decode.engine.shutdown()
        prefill.engine.shutdown()


@pytest.fixture
async def rig():
    async with _servers(_ecfg(), PrefillConfig(), CollectorRegistry()) as servers:
        yield servers


async def _reserve(stub, n: int = 6) -> decode_pb2.ReserveResponse:
    return await stub.Reserve(decode_pb2.ReserveRequest(request_id="r", token_ids=PROMPT,
                                                        params=common_pb2.SamplingParams(max_tokens=n, temperature=0)))


def _prefill_req(resv: decode_pb2.ReserveResponse) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(request_id="r", token_ids=PROMPT, decode_address="decode-x",
                                      reservation_id=resv.reservation_id, num_skip_blocks=resv.num_cached_blocks,
                                      expected_layout_fingerprint=resv.layout.fingerprint,
                                      dest_block_ids=resv.block_ids, reservation_token=resv.reservation_token,
                                      destination=resv.destination,
                                      accepted_wire_fingerprints=resv.accepted_wire_fingerprints,
                                      params=common_pb2.SamplingParams(max_tokens=6, temperature=0))


async def _generate(dstub, pstub, resv: decode_pb2.ReserveResponse
                    ) -> tuple[list[int], prefill_pb2.PrefillResponse]:
    """Decode's token stream for ``resv`` and the Prefill answer, the stream opened first."""
    tokens: list[int] = []

    async def consume():
        async for msg in dstub.Generate(decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id)):
            tokens.extend(msg.token_ids)

    task = asyncio.create_task(consume())
    resp = await pstub.Prefill(_prefill_req(resv))
    await task
    return tokens, resp


async def _refused_prefill(rig, **fault: int) -> tuple[decode_pb2.ReserveResponse, grpc.aio.AioRpcError]:
    """With ``fault`` set on the transport (a Faults field), the reservation and the Prefill's error."""
    _, _, faults, dstub, pstub = rig
    for name, value in fault.items():
        setattr(faults, name, value)
    resv = await _reserve(dstub)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await pstub.Prefill(_prefill_req(resv))
    return resv, err.value


async def _idle(servicer) -> dict[str, float]:
    for _ in range(50):
        s = await servicer.engine.stats()
        if s["free_blocks"] == s["total_blocks"] and not (s["running"] + s["waiting"] + s["waiting_for_kv"]):
            return s
        await asyncio.sleep(0.05)
    return s


async def test_fake_handoff_gives_the_colocated_tokens(rig):
    _, prefill, _, dstub, pstub = rig
    tokens, resp = await _generate(dstub, pstub, await _reserve(dstub))
    want = LLMEngine(_ecfg()).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0]
    assert tokens == want and resp.first_token == want[0]
    # Chunked transfer, 7-token chunks: page 0 goes after chunk 3 (21 tokens), page 1 after chunk 5 (35),
    # page 2 (partial) with the last chunk: three messages.
    assert resp.num_chunks == 3
    s = await _idle(prefill)
    assert s["free_blocks"] == s["total_blocks"]


async def test_injected_transport_failure_fails_prefill_and_frees_its_blocks(rig):
    decode, prefill, _, dstub, _ = rig
    resv, err = await _refused_prefill(rig, fail_after_chunks=1)
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "KV handoff" in err.details()
    detail = detail_of(err)
    assert (detail.reason, detail.retryable, detail.side) == (Reason.ERROR_REASON_KV_HANDOFF_FAILED, False, "decode")
    s = await _idle(prefill)
    assert s["free_blocks"] == s["total_blocks"] and s["running"] == 0
    # Decode still holds the reservation (a retried prefill may resend); Abort frees it.
    assert (await decode.engine.stats())["waiting_for_kv"] == 1
    await dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    s = await _idle(decode)
    assert s["free_blocks"] == s["total_blocks"]


async def test_corrupted_chunk_is_refused_by_decode(rig):
    decode, prefill, *_ = rig
    _, err = await _refused_prefill(rig, corrupt_chunk=0)
    assert err.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.details()
    for side in (prefill, decode):
        s = await _idle(side)
        assert s["free_blocks"] == s["total_blocks"] and s["waiting_for_kv"] == 0


async def test_fp8_wire_codec_halves_bytes_and_decodes_within_fp8_precision(rig):
    decode, prefill, _, dstub, pstub = rig
    prefill.config.kv_wire_codec = "fp8-e4m3"
    resv = await _reserve(dstub, n=1)
    assert decode.engine.engine.fp8_layout.fingerprint in resv.accepted_wire_fingerprints
    resp = await pstub.Prefill(_prefill_req(resv))
    fp8_layout = prefill.engine.engine.fp8_layout
    assert resp.kv_bytes_sent == 3 * fp8_layout.page_bytes < 3 * prefill.layout.page_bytes // 3

    # The KV decode holds for the prompt equals the colocated engine's, within fp8-e4m3 precision.
    ref = LLMEngine(_ecfg())
    tables: list[list[int]] = []
    ref.chunk_listeners.append(lambda ch, _s: tables.append(list(ch.seq.block_table)))
    ref.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    want = ref.runner.read_pages(tables[-1])            # [3, L, 2, bs, kvh, hd]
    got = decode.engine.engine.runner.read_pages(list(resv.block_ids))
    flat_w = want.permute(0, 3, 1, 2, 4, 5).reshape(3 * 16, -1, want.shape[-1])[: len(PROMPT)]
    flat_g = got.permute(0, 3, 1, 2, 4, 5).reshape(3 * 16, -1, got.shape[-1])[: len(PROMPT)]
    amax = flat_w.abs().amax(dim=-1, keepdim=True)      # per token, per (layer, K/V, head)
    assert ((flat_g - flat_w).abs() <= amax / 16 + 1e-6).all()
    assert not torch.equal(flat_g, flat_w)              # it really went through the codec


async def test_shm_transport_writes_into_a_shared_decode_pool_and_gives_the_colocated_tokens() -> None:
    """Decode's pool in /dev/shm (offered as a typed ShmPool in Reserve); prefill writes pages into it and
    sends descriptors only."""
    registry = CollectorRegistry()
    async with _servers(dataclasses.replace(_ecfg(), kv_cache_shared=True), PrefillConfig(kv_transport="shm"),
                        registry) as (decode, prefill, _, dstub, pstub):
        path = decode.engine.engine.runner.kv_shm_path
        resv = await _reserve(dstub)
        assert resv.destination.WhichOneof("pool") == "shm" and resv.destination.shm.name in path
        tokens, resp = await _generate(dstub, pstub, resv)
        want = LLMEngine(_ecfg()).generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))[0]
        assert tokens == want and resp.kv_bytes_sent == 3 * prefill.layout.page_bytes
        assert registry.get_sample_value("pdserve_prefill_kv_sent_bytes_total", {"transport": "shm"}) == \
            resp.kv_bytes_sent
    assert not await asyncio.to_thread(os.path.exists, path)  # the pool's file goes with decode
