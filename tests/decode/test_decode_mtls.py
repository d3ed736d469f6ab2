"""With mTLS on, only a peer whose certificate says ``prefill`` may push KV into a decode (and it still
needs the reservation's token); the router's certificate may reserve but not write pages."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.grpc_util import Reason, create_channel
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.decode.config import DecodeConfig
from services.decode.servicer import DecodeServicer
from services.engine.async_engine import AsyncEngine
from tests.decode.kv_util import PROMPT, chunks, ecfg, generate, idle, prompt, push, reference, reserve


def _tls(certs: Path, role: str) -> TLSConfig:
    return TLSConfig(tls_cert=str(certs / f"{role}.pem"), tls_key=str(certs / f"{role}-key.pem"),
                     tls_ca=str(certs / "ca.pem"))


@pytest.fixture
async def tls_decode(tmp_path: Path):
    certs = make_certs(tmp_path / "certs")
    cfg = DecodeConfig(host="127.0.0.1", port=0, metrics_port=-1, tls_cert=str(certs / "decode.pem"),
                       tls_key=str(certs / "decode-key.pem"), tls_ca=str(certs / "ca.pem"))
    servicer = DecodeServicer(cfg, DecodeMetrics(CollectorRegistry()), asyncio.Event())
    servicer.bind(await asyncio.to_thread(AsyncEngine, ecfg()))
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", cfg.server_credentials())
    await server.start()
    yield servicer, f"127.0.0.1:{port}", certs
    await server.stop(None)
    await servicer.close()
    servicer.engine.shutdown()


async def test_only_a_prefill_certificate_may_push_kv(tls_decode):
    servicer, addr, certs = tls_decode
    base = await idle(servicer.engine)
    ref = reference(PROMPT, 6)
    async with create_channel(addr, tls=_tls(certs, "router")) as router, \
            create_channel(addr, tls=_tls(certs, "prefill")) as prefill:
        resv = await reserve(decode_pb2_grpc.DecodeStub(router))
        out = await push(decode_pb2_grpc.DecodeStub(router), chunks(resv, PROMPT, ref))
        assert out.code == grpc.StatusCode.PERMISSION_DENIED and out.detail.reason == Reason.ERROR_REASON_PERMISSION
        assert servicer.table.get(resv.reservation_id) is not None  # untouched
        pstub = decode_pb2_grpc.DecodeStub(prefill)
        out = await push(pstub, chunks(resv, PROMPT, ref, token=bytes(16)))  # right role, wrong token
        assert out.code == grpc.StatusCode.PERMISSION_DENIED
        assert (await push(pstub, chunks(resv, PROMPT, ref))).code == grpc.StatusCode.OK
        tokens, _, out = await generate(decode_pb2_grpc.DecodeStub(router),
                                        decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id))
        assert out.code == grpc.StatusCode.OK and tokens == ref.tokens
    assert (await idle(servicer.engine))["free_blocks"] == base["free_blocks"]


async def test_only_the_router_certificate_may_reserve_generate_or_abort(tls_decode):
    servicer, addr, certs = tls_decode
    base = await idle(servicer.engine)
    async with create_channel(addr, tls=_tls(certs, "router")) as router, \
            create_channel(addr, tls=_tls(certs, "prefill")) as prefill:
        pstub = decode_pb2_grpc.DecodeStub(prefill)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await reserve(pstub)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        resv = await reserve(decode_pb2_grpc.DecodeStub(router))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pstub.Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert servicer.table.get(resv.reservation_id) is not None  # a prefill cannot cancel others' work
        found = await decode_pb2_grpc.DecodeStub(router).Abort(common_pb2.AbortRequest(request_id=resv.reservation_id))
        assert found.found
    assert (await idle(servicer.engine))["free_blocks"] == base["free_blocks"]


async def test_a_flood_of_maximal_leases_from_one_caller_leaves_room_for_another(tmp_path: Path):
    """Caller identity is the certificate's CN: while router-b waits for the KV of one reservation,
    router-a floods Reserve with the largest lease and never sends KV; it is stopped at its share (half
    the pool), router-b still reserves, and router-a's leases are the server's --lease-ms (not
    --max-lease-ms) because no KV arrived."""
    certs = make_certs(tmp_path / "ids", roles=("decode", "router-a", "router-b"))
    cfg = DecodeConfig(host="127.0.0.1", port=0, metrics_port=-1, lease_ms=30_000, max_lease_ms=300_000,
                       tls_cert=str(certs / "decode.pem"), tls_key=str(certs / "decode-key.pem"),
                       tls_ca=str(certs / "ca.pem"))
    servicer = DecodeServicer(cfg, DecodeMetrics(CollectorRegistry()), asyncio.Event())
    servicer.bind(await asyncio.to_thread(AsyncEngine, ecfg()))
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, server)
    addr = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', cfg.server_credentials())}"
    await server.start()
    try:
        base = await idle(servicer.engine)
        total = base["total_blocks"]
        async with create_channel(addr, tls=_tls(certs, "router-a")) as a, \
                create_channel(addr, tls=_tls(certs, "router-b")) as b:
            waiting = await reserve(decode_pb2_grpc.DecodeStub(b), prompt(9_999, 40), request_id="waiting")
            flood, refused_n = [], 0
            for i in range(total):  # far more than the pool holds
                try:
                    flood.append(await reserve(decode_pb2_grpc.DecodeStub(a), prompt(i, 40), lease_ms=4294967295,
                                               request_id=f"flood-{i}"))
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                    refused_n += 1
            held = sum(len(r.block_ids) for r in flood)
            assert 0 < held <= total // 2 and refused_n > 0, (held, total, refused_n)
            assert all(r.lease_expires_unix <= time.time() + 30.0 for r in flood)  # not the 300 s maximum
            other = await reserve(decode_pb2_grpc.DecodeStub(b), prompt(10_000, 40), request_id="victim")
            assert len(other.block_ids) == 3
            for r in [*flood, other, waiting]:
                await decode_pb2_grpc.DecodeStub(a if r in flood else b).Abort(
                    common_pb2.AbortRequest(request_id=r.reservation_id))
        assert (await idle(servicer.engine))["free_blocks"] == base["free_blocks"]
    finally:
        await server.stop(None)
        await servicer.close()
        servicer.engine.shutdown()
