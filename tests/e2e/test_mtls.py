"""A local cluster with mTLS between every service (LocalCluster(tls_dir=...), what `pdserve up` runs by default):
requests flow through the router; internal RPCs refuse a caller without a certificate from the
cluster's CA; a certificate whose role is not prefill cannot write pages into the kvstore."""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common.grpc_util import create_channel
from services.common.kvstore_pages import split_page
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.kvstore.backend import FINGERPRINT_CHARS, HASH_SIZE
from services.launcher import LocalCluster, served_model
from tests.e2e.cluster_util import post_json, rpc_code

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KV = ["--kv-cache-bytes", str(96 << 20)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("pdserve-ca"))


@pytest.fixture(scope="module")
def cluster(certs: Path) -> Iterator[LocalCluster]:
    extra = {"prefill": KV, "decode": KV}
    with LocalCluster(prefill=1, decode=1, kvstore="embedded", kv_transport="grpc", tls_dir=certs, extra=extra,
                      quiet=True) as c:
        yield c


def tls_as(certs: Path, role: str, ca_dir: Path | None = None) -> TLSConfig:
    return TLSConfig(tls_cert=str(certs / f"{role}.pem"), tls_key=str(certs / f"{role}-key.pem"),
                     tls_ca=str((ca_dir or certs) / "ca.pem"))


def reserve(address: str, tls: TLSConfig | None) -> tuple[grpc.StatusCode, str]:
    async def call() -> None:
        async with create_channel(address, tls=tls) as ch:
            await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
                request_id="mtls-test", token_ids=[1, 2, 3, 4, 5], lease_ms=1000,
                params=common_pb2.SamplingParams(max_tokens=1)), timeout=20)
    return rpc_code(call)


def put_page(address: str, tls: TLSConfig | None) -> tuple[grpc.StatusCode, str]:
    data = b"forged page " * 64
    fp, h = "ab" * (FINGERPRINT_CHARS // 2), b"\x07" * HASH_SIZE

    async def call() -> None:
        async with create_channel(address, tls=tls) as ch:
            resp = await kvstore_pb2_grpc.KVStoreStub(ch).Put(iter(split_page(fp, h, data, zlib.crc32(data))),
                                                            timeout=20)
            assert resp.stored == 1
            await kvstore_pb2_grpc.KVStoreStub(ch).Delete(kvstore_pb2.DeleteRequest(
                layout_fingerprint=fp, block_hashes=[h]), timeout=20)
    return rpc_code(call)


def test_chat_completion_through_the_mtls_cluster(cluster: LocalCluster) -> None:
    http = cluster.router["http"]
    status, body = post_json(http, "/v1/chat/completions", {
        "model": served_model(http), "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]


def test_no_certificate_cannot_reserve_or_put(cluster: LocalCluster) -> None:
    decode, kvstore = cluster.get("decode-0").ready["grpc"], cluster.get("kvstore").ready["grpc"]
    assert reserve(decode, None)[0] == grpc.StatusCode.UNAVAILABLE
    assert put_page(kvstore, None)[0] == grpc.StatusCode.UNAVAILABLE


def test_certificate_from_another_ca_cannot_reserve_or_put(cluster: LocalCluster, certs: Path,
                                                          tmp_path: Path) -> None:
    other = make_certs(tmp_path / "other-ca", roles=("prefill", "router"))
    decode, kvstore = cluster.get("decode-0").ready["grpc"], cluster.get("kvstore").ready["grpc"]
    assert reserve(decode, tls_as(other, "router", ca_dir=certs))[0] == grpc.StatusCode.UNAVAILABLE
    assert put_page(kvstore, tls_as(other, "prefill", ca_dir=certs))[0] == grpc.StatusCode.UNAVAILABLE


def test_only_a_prefill_certificate_may_put_pages(cluster: LocalCluster, certs: Path) -> None:
    kvstore = cluster.get("kvstore").ready["grpc"]
    code, details = put_page(kvstore, tls_as(certs, "router"))
    assert code == grpc.StatusCode.PERMISSION_DENIED, (
        f"a router-role certificate wrote KV pages into the kvstore ({code.name}: {details}); the role check "
        "on kvstore Put is missing")
    assert put_page(kvstore, tls_as(certs, "prefill")) == (grpc.StatusCode.OK, "")


def test_a_router_certificate_may_reserve(cluster: LocalCluster, certs: Path) -> None:
    assert reserve(cluster.get("decode-0").ready["grpc"], tls_as(certs, "router"))[0] == grpc.StatusCode.OK
