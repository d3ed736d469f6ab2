"""Every KV transport end to end in one process: real prefill and decode servicers (random tiny Llama, fp32)
on real gRPC servers, the PushKV stream over loopback, and the page bytes in the stream (grpc), copied
into decode's /dev/shm pool (shm) or written by the Mooncake Transfer Engine over loopback TCP
(mooncake). CUDA IPC runs in the GPU suite."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.grpc_util import Reason, detail_of
from services.common.metrics import DecodeMetrics, PrefillMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.pushkv_wire import add_decode_servicer
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.config import EngineConfig
from services.engine.core_client import EngineCoreClient
from services.engine.engine import LLMEngine
from services.engine.kv_transport import GrpcStreamTransport, mooncake
from services.prefill import kv_stream
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.text.sampling_params import SamplingParams

PROMPTS = [[(i * 37) % 250 + 1 for i in range(45)], [(i * 53) % 500 + 3 for i in range(130)]]
ENGINE = EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=64, max_prefill_chunk=16)
NO_MOONCAKE = mooncake.available()
TRANSPORTS = ["grpc", "shm", pytest.param("mooncake", marks=pytest.mark.skipif(
    NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}"))]


@dataclass
class Pair:
    transport: str
    decode: DecodeServicer
    prefill: PrefillServicer
    registry: CollectorRegistry
    dstub: decode_pb2_grpc.DecodeStub
    pstub: prefill_pb2_grpc.PrefillStub
    decode_address: str
    servers: list[grpc.aio.Server]

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


async def _serve(servicer, add) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def pair() -> AsyncIterator:
    made: list[Pair] = []
    channels: list[grpc.aio.Channel] = []

    async def make(transport: str, slowdown_ms: int = 0, prefill_engine: EngineConfig = ENGINE,
                   decode_engine: EngineConfig | None = None, core: bool = False) -> Pair:
        """``core``: the prefill's step loop in an engine-core process (its front maps the pool)."""
        decode = DecodeServicer(DecodeConfig(kv_mooncake_host="127.0.0.1" if transport == "mooncake" else ""),
                                DecodeMetrics(CollectorRegistry()), asyncio.Event())
        decode.bind(await asyncio.to_thread(AsyncEngine, dataclasses.replace(decode_engine or ENGINE,
                                                                             kv_cache_shared=transport == "shm")))
        dserver, daddr = await _serve(decode, add_decode_servicer)
        registry = CollectorRegistry()
        prefill = PrefillServicer(PrefillConfig(kv_transport=transport, slowdown_ms_per_chunk=slowdown_ms),
                                  PrefillMetrics(registry), GrpcStreamTransport(), asyncio.Event())
        prefill.bind(await EngineCoreClient.start(prefill_engine, "prefill", role="prefill") if core
                     else await asyncio.to_thread(AsyncEngine, prefill_engine))
        pserver, paddr = await _serve(prefill, prefill_pb2_grpc.add_PrefillServicer_to_server)
        dch, pch = grpc.aio.insecure_channel(daddr), grpc.aio.insecure_channel(paddr)
        channels.extend([dch, pch])
        p = Pair(transport, decode, prefill, registry, decode_pb2_grpc.DecodeStub(dch),
                 prefill_pb2_grpc.PrefillStub(pch), daddr, [dserver, pserver])
        made.append(p)
        return p

    yield make
    for ch in channels:
        await ch.close()
    for p in made:
        for s in p.servers:
            await s.stop(None)
        await p.prefill.transport.close()
        p.decode.engine.shutdown()
        await asyncio.to_thread(p.prefill.engine.shutdown)  # an engine core's STOP is written on this loop


async def _reserve(p: Pair, ids: list[int], n: int = 6) -> decode_pb2.ReserveResponse:
    return await p.dstub.Reserve(decode_pb2.ReserveRequest(
        request_id="r", token_ids=ids, params=common_pb2.SamplingParams(max_tokens=n, temperature=0)))


def _request(p: Pair, resv: decode_pb2.ReserveResponse, ids: list[int], **kw) -> prefill_pb2.PrefillRequest:
    req = prefill_pb2.PrefillRequest(
        request_id="r", token_ids=ids, decode_address=p.decode_address, reservation_id=resv.reservation_id,
        num_skip_blocks=resv.num_cached_blocks, expected_layout_fingerprint=resv.layout.fingerprint,
        dest_block_ids=resv.block_ids, reservation_token=resv.reservation_token,
        accepted_wire_fingerprints=resv.accepted_wire_fingerprints,
        params=common_pb2.SamplingParams(max_tokens=6, temperature=0), **kw)
    req.destination.CopyFrom(resv.destination)
    return req


async def _generate(p: Pair, resv: decode_pb2.ReserveResponse) -> list[int]:
    tokens: list[int] = []
    async for msg in p.dstub.Generate(decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id)):
        tokens.extend(msg.token_ids)
    return tokens


async def _idle(engine: AsyncEngine) -> dict[str, float]:
    s: dict[str, float] = {}
    for _ in range(400):  # up to 20 s: a busy box may take seconds to run the aborts
        s = await engine.stats()
        if s["free_blocks"] == s["total_blocks"] and not (s["running"] + s["waiting"] + s["waiting_for_kv"]):
            return s
        await asyncio.sleep(0.05)
    return s


async def _assert_freed(*engines: AsyncEngine) -> None:
    for eng in engines:
        s = await _idle(eng)
        assert s["free_blocks"] == s["total_blocks"]


async def _request_into_other_blocks(p: Pair, ids: list[int], other_ids: list[int]
                                     ) -> tuple[decode_pb2.ReserveResponse, decode_pb2.ReserveResponse,
                                                prefill_pb2.PrefillRequest]:
    """(reservation of ``ids``, another reservation, a Prefill request for the first whose dest_block_ids are
    the other's blocks): decode refuses its claim."""
    resv = await _reserve(p, ids)
    other = await _reserve(p, other_ids[:len(ids)])
    req = _request(p, resv, ids)
    del req.dest_block_ids[:]
    req.dest_block_ids.extend(other.block_ids)
    return resv, other, req


async def _refused_unclaimed(p: Pair, resv: decode_pb2.ReserveResponse, ids: list[int]) -> grpc.aio.AioRpcError:
    """Prefill of ``resv`` whose KV claim decode does not acknowledge within ``claim_wait_s``: refused
    UNAVAILABLE, retryable, not a failed handoff (the router retries it with the same reservation)."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.pstub.Prefill(_request(p, resv, ids))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    detail = detail_of(e.value)
    assert detail.retryable and detail.reason != Reason.ERROR_REASON_KV_HANDOFF_FAILED  # the router retries it
    assert "did not acknowledge the KV claim" in e.value.details()
    return e.value


async def _until(cond, tries: int = 200) -> None:
    """Poll ``cond()`` every 20 ms until true, ``tries`` times at most (the caller asserts the outcome)."""
    for _ in range(tries):
        if cond():
            return
        await asyncio.sleep(0.02)


async def _mid_transfer(pair, transport: str, core: bool = False):
    """A slowed pair, one reservation, its Prefill call under way, and the decode-side reservation once some of
    its KV landed (``core``: the prefill's loop in an engine core)."""
    assert not (core and transport == "mooncake"), "a prefill engine core does not write through mooncake"
    p = await (pair(transport, slowdown_ms=150, core=True) if core else pair(transport, slowdown_ms=150))
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    call = p.pstub.Prefill(_request(p, resv, ids))
    r = p.decode.table.get(resv.reservation_id)
    await _until(lambda: r.next_chunk > 0)
    return p, resv, call, r


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_each_transport_gives_the_in_process_engines_tokens(pair, transport: str, core: bool = False) -> None:
    """``core``: the prefill's loop in an engine-core process, its front reading the pages from the shared pool
    (test_engine_core_prefill.py runs it so)."""
    p = await (pair(transport, core=True) if core else pair(transport))
    offered = {"grpc": None, "shm": "shm", "mooncake": "mooncake"}[transport]
    sent = 0
    for ids in PROMPTS:
        resv = await _reserve(p, ids)
        assert resv.destination.WhichOneof("pool") == offered
        consume = asyncio.create_task(_generate(p, resv))
        resp = await p.pstub.Prefill(_request(p, resv, ids))
        tokens = await consume
        want = LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
        assert tokens == want
        assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
        sent += resp.kv_bytes_sent
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport=transport) == sent
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport=transport, reason="none") == 0
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_grpc_chunks_split_into_one_page_messages_land_identically(pair, monkeypatch) -> None:
    """Messages capped at one page (kv_stream.MESSAGE_PAYLOAD_BYTES): every compute chunk leaves as
    several messages, each parsed header-only by decode, and the tokens are the in-process engine's."""
    p = await pair("grpc", prefill_engine=dataclasses.replace(ENGINE, max_prefill_chunk=128))
    monkeypatch.setattr(kv_stream, "MESSAGE_PAYLOAD_BYTES", p.prefill.layout.page_bytes)
    ids = PROMPTS[1]
    resv = await _reserve(p, ids)
    consume = asyncio.create_task(_generate(p, resv))
    resp = await p.pstub.Prefill(_request(p, resv, ids))
    assert await consume == LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
    assert resp.kv_bytes_sent == len(resv.block_ids) * p.prefill.layout.page_bytes
    received = p.decode.metrics.kv_chunks_received_total.labels("grpc")._value.get()
    assert received == len(resv.block_ids)  # 2 compute chunks (128 + 2 tokens), 9 pages: a message per page
    await _assert_freed(p.decode.engine, p.prefill.engine)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_prefill_gone_mid_transfer_keeps_the_reservation_then_abort_frees_it(pair, transport: str,
                                                                                    core: bool = False) -> None:
    """``core``: the prefill's loop in an engine core (test_engine_core_prefill.py runs it so)."""
    p, resv, call, r = await _mid_transfer(pair, transport, core)
    assert r.next_chunk > 0
    call.cancel()  # the prefill's caller went away: prefill frees its work and breaks the stream
    await _until(lambda: not r.receiving)
    # Wave-1 rule: a broken stream keeps the reservation (a retried prefill resends from chunk 0).
    assert not r.receiving and r.end_cause is None and p.decode.table.get(resv.reservation_id) is r
    assert r.next_chunk == 0 and not r.pages_written
    assert p.decode.metrics.kv_streams_broken_total.labels(p.decode.model)._value.get() >= 1
    assert (await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))).found
    await _assert_freed(p.decode.engine, p.prefill.engine)


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_decode_gone_mid_transfer_fails_prefill_as_a_handoff_failure(pair, transport: str, core: bool = False
                                                                            ) -> None:
    """``core``: the prefill's loop in an engine core (test_engine_core_prefill.py runs it so)."""
    p, _resv, call, _r = await _mid_transfer(pair, transport, core)
    await p.servers[0].stop(None)  # decode's server goes away
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    d = detail_of(e.value)
    assert d.reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED and d.side == "decode"
    await _assert_freed(p.prefill.engine)
    assert p.metric("pdserve_prefill_kv_transfer_failures_total", transport=transport,
                    reason=e.value.code().name.lower()) == 1


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "grpc"])
async def test_a_descriptor_for_another_reservation_is_refused(pair, transport: str) -> None:
    p = await pair(transport)
    ids, other_ids = PROMPTS
    resv = await _reserve(p, ids)
    other = await _reserve(p, other_ids[:len(ids)])
    req = _request(p, resv, ids)
    del req.dest_block_ids[:]
    req.dest_block_ids.extend(other.block_ids)  # the other reservation's blocks, with this one's token
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.pstub.Prefill(req)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
    assert "claim.dest_block_ids" in e.value.details()
    # Neither reservation was touched: both still wait for their KV.
    assert all(p.decode.table.get(x.reservation_id).next_chunk == 0 for x in (resv, other))
    for x in (resv, other):
        await p.dstub.Abort(common_pb2.AbortRequest(request_id=x.reservation_id))
    await _assert_freed(p.decode.engine, p.prefill.engine)


@pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")
async def test_a_mooncake_descriptor_for_another_host_is_refused_and_counted(pair) -> None:
    p = await pair("mooncake")
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    req = _request(p, resv, ids)
    port = req.destination.mooncake.segment.rsplit(":", 1)[1]
    req.destination.mooncake.segment = f"10.255.0.1:{port}"  # a segment elsewhere than the decode
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(req)  # the pages went as bytes in the stream instead
    assert len(await consume) == 6
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="host") == 1
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="grpc") > 0
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == 0
