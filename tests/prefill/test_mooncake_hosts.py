"""mooncake across two "hosts": decode (its gRPC server and its transfer engines) at 127.0.0.3, prefill at
127.0.0.2 (Linux routes all of 127/8 over loopback, so these are two distinct addresses as two hosts
would be). Decode advertises 127.0.0.3 segments, never 127.0.0.1; every chunk is spread over two engines
per side; a descriptor naming another host, another pool or another reservation is refused."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import DecodeMetrics, PrefillMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.pushkv_wire import add_decode_servicer
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from services.engine.engine import LLMEngine
from services.engine.kv_transport import GrpcStreamTransport, mooncake
from services.engine.shared_kv import SharedKVAttachError
from services.prefill.config import PrefillConfig
from services.prefill.servicer import PrefillServicer
from services.text.sampling_params import SamplingParams
from tests.prefill.test_transports import (
    ENGINE,
    PROMPTS,
    Pair,
    _assert_freed,
    _generate,
    _request,
    _reserve,
)
from tests.prefill.test_transports import (
    test_a_descriptor_for_another_reservation_is_refused as _other_reservation_refused,
)

DECODE_HOST, PREFILL_HOST = "127.0.0.3", "127.0.0.2"
ENGINES = 2
NO_MOONCAKE = mooncake.available()


def _loopback_hosts() -> str | None:
    """None when 127.0.0.2 can reach a listener on 127.0.0.3, else why not."""
    try:
        with socket.socket() as srv, socket.socket() as cli:
            srv.bind((DECODE_HOST, 0))
            srv.listen(1)
            cli.bind((PREFILL_HOST, 0))
            cli.connect(srv.getsockname())
    except OSError as e:
        return f"127.0.0.2 -> 127.0.0.3 over loopback fails here: {e}"
    return None


NO_HOSTS = _loopback_hosts()
pytestmark = [pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}"),
              pytest.mark.skipif(NO_HOSTS is not None, reason=NO_HOSTS or "")]


async def _serve(servicer, add, host: str) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    return server, f"{host}:{port}"


@pytest.fixture
async def hosts() -> AsyncIterator[Pair]:
    decode = DecodeServicer(DecodeConfig(kv_mooncake_host=DECODE_HOST, kv_mooncake_engines=ENGINES),
                            DecodeMetrics(CollectorRegistry()), asyncio.Event())
    decode.bind(await asyncio.to_thread(AsyncEngine, ENGINE))
    dserver, daddr = await _serve(decode, add_decode_servicer, DECODE_HOST)
    registry = CollectorRegistry()
    prefill = PrefillServicer(PrefillConfig(kv_transport="mooncake", kv_mooncake_host=PREFILL_HOST,
                                            kv_mooncake_engines=ENGINES),
                              PrefillMetrics(registry), GrpcStreamTransport(), asyncio.Event())
    prefill.bind(await asyncio.to_thread(AsyncEngine, ENGINE))
    pserver, paddr = await _serve(prefill, prefill_pb2_grpc.add_PrefillServicer_to_server, PREFILL_HOST)
    dch, pch = grpc.aio.insecure_channel(daddr), grpc.aio.insecure_channel(paddr)
    p = Pair("mooncake", decode, prefill, registry, decode_pb2_grpc.DecodeStub(dch), prefill_pb2_grpc.PrefillStub(pch),
             daddr, [dserver, pserver])
    yield p
    for ch in (dch, pch):
        await ch.close()
    for s in p.servers:
        await s.stop(None)
    await prefill.transport.close()
    decode.engine.shutdown()
    prefill.engine.shutdown()


async def test_pages_cross_hosts_spread_over_engines_and_give_the_in_process_tokens(hosts: Pair) -> None:
    p = hosts
    sent = 0
    for ids in PROMPTS:
        resv = await _reserve(p, ids)
        pool = resv.destination.mooncake
        segments = [pool.segment, *pool.extra_segments]
        assert len(segments) == ENGINES and len(set(segments)) == ENGINES
        assert all(s.rsplit(":", 1)[0] == DECODE_HOST for s in segments)  # the advertised host, not 127.0.0.1
        consume = asyncio.create_task(_generate(p, resv))
        resp = await p.pstub.Prefill(_request(p, resv, ids))
        want = LLMEngine(ENGINE).generate([ids], SamplingParams(max_tokens=6, temperature=0))[0]
        assert await consume == want
        sent += resp.kv_bytes_sent
    engine = p.prefill.direct._mooncake
    assert engine is not None and engine.hostname == PREFILL_HOST and len(engine.tes) == ENGINES
    assert all(s.startswith(f"{PREFILL_HOST}:") for s in engine.segments)
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == sent > 0
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="grpc") == 0
    await _assert_freed(p.decode.engine, p.prefill.engine)


@pytest.mark.parametrize("field", ["segment", "extra_segments"])
async def test_a_segment_on_another_host_is_never_written_and_counted(hosts: Pair, field: str) -> None:
    """A destination naming the prefill's own host (not the decode the stream goes to) in any of its
    segments: nothing is written over Mooncake, the pages go as bytes in the stream, counted as reason host."""
    p = hosts
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    req = _request(p, resv, ids)
    pool = req.destination.mooncake
    if field == "segment":
        pool.segment = f"{PREFILL_HOST}:{pool.segment.rsplit(':', 1)[1]}"
    else:
        pool.extra_segments[0] = f"{PREFILL_HOST}:{pool.extra_segments[0].rsplit(':', 1)[1]}"
    consume = asyncio.create_task(_generate(p, resv))
    await p.pstub.Prefill(req)
    assert len(await consume) == 6
    assert p.metric("pdserve_prefill_kv_transport_fallbacks_total", transport="mooncake", reason="host") == 1
    assert p.metric("pdserve_prefill_kv_sent_bytes_total", transport="mooncake") == 0
    await _assert_freed(p.decode.engine, p.prefill.engine)


async def test_a_descriptor_for_another_reservation_is_refused_across_hosts(hosts: Pair) -> None:
    async def same(_transport: str) -> Pair:
        return hosts

    await _other_reservation_refused(same, "mooncake")  # the one-host test's body, on the two-host pair


async def test_a_descriptor_for_another_pool_is_refused_before_any_write(hosts: Pair) -> None:
    """The same host but another registered buffer (base address moved by one slot): decode refuses the
    claim (the writer writes nothing before the claim is acknowledged) and its reservation is untouched."""
    p = hosts
    ids = PROMPTS[0]
    resv = await _reserve(p, ids)
    req = _request(p, resv, ids)
    pool = req.destination.mooncake
    pool.base_address += pool.pool_bytes // pool.shape[2]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await p.pstub.Prefill(req)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "claim.pool_id" in e.value.details()
    assert p.decode.table.get(resv.reservation_id).next_chunk == 0
    await p.dstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
    await _assert_freed(p.decode.engine, p.prefill.engine)


def _pool(segment: str, *extra: str) -> decode_pb2.MooncakePool:
    return decode_pb2.MooncakePool(segment=segment, extra_segments=list(extra), base_address=4096,
                                   pool_bytes=2 * 2 * 4 * 16 * 2 * 8 * 4, shape=[2, 2, 4, 16, 2, 8], dtype="float32")


def test_segment_hosts_match_the_decode_address_by_name_or_address() -> None:
    mooncake.check_pool(_pool("127.0.0.3:15001", "127.0.0.3:15002"), "127.0.0.3:50062")
    mooncake.check_pool(_pool("127.0.0.1:15001"), "localhost:50062")  # a name that resolves to the segment's host
    for pool, decode in [(_pool("127.0.0.2:15001"), "127.0.0.3:50062"),
                         (_pool("127.0.0.3:15001", "10.255.0.1:15002"), "127.0.0.3:50062"),
                         (_pool("127.0.0.9:15001"), "localhost:50062")]:
        with pytest.raises(SharedKVAttachError) as e:
            mooncake.check_pool(pool, decode)
        assert e.value.reason == "host"
    with pytest.raises(SharedKVAttachError) as e:
        mooncake.check_pool(_pool("127.0.0.3:15001", "127.0.0.3:x"), "127.0.0.3:50062")
    assert e.value.reason == "segment"


def test_engines_advertise_their_declared_host_and_take_no_stale_bind_address() -> None:
    """Two engines made one after the other in one process, each for its own address: each advertises its
    own host (MC_TCP_BIND_ADDRESS is set from the declared host for each, never inherited)."""
    a = mooncake.MooncakeEngine(DECODE_HOST, count=2)
    b = mooncake.MooncakeEngine(PREFILL_HOST)
    assert [s.rsplit(":", 1)[0] for s in a.segments] == [DECODE_HOST] * 2 and len(set(a.segments)) == 2
    assert b.segment.rsplit(":", 1)[0] == PREFILL_HOST
    del a, b
