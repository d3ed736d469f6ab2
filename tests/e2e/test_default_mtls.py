"""Default `pdserve up` (no TLS flag): every internal gRPC port runs mTLS with certificates made at start.

A caller without a certificate is refused on each service's port (router, prefill, decode, kvstore);
a certified caller of the wrong role cannot plant pages (kvstore Put, Reserve + PushKV) or reserve; and
a victim's greedy answer is the same before and after those attempts. The certificate directory is
removed when the cluster stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import create_channel
from services.common.kvstore_pages import split_page
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc, kvstore_pb2_grpc
from services.common.tls import DEFAULT_SERVER_NAME, TLSConfig
from services.kvstore.backend import FINGERPRINT_CHARS, HASH_SIZE
from services.launcher import served_model
from tests.e2e.cluster_util import post_json, rpc_code

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VICTIM = "What is the capital of France?"


@dataclass
class Up:
    proc: subprocess.Popen[str]
    lines: list[str]
    grpc: dict[str, str]
    """service name -> its gRPC address, as `pdserve up` printed them."""
    http: str
    certs: Path


def _read(stream, out: queue.Queue[str]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


@pytest.fixture(scope="module")
def up() -> Iterator[Up]:
    env = {**os.environ, "PDSERVE_KV_CACHE_BYTES": str(96 << 20), "PDSERVE_CPU_COMPILE_DECODE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--kv-transport", "grpc",
                             "--http-port", "0", "--grpc-port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    q: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read, args=(proc.stdout, q), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 240
        while not any("pdserve up: serving." in ln for ln in seen):
            assert proc.poll() is None, "\n".join(seen[-40:])
            assert time.monotonic() < deadline, "\n".join(seen[-40:])
            with contextlib.suppress(queue.Empty):
                seen.append(q.get(timeout=1))
        addrs = {ln.split()[0]: m.group(1) for ln in seen if (m := re.match(r"  \S+ +.*grpc=(\S+)", ln))}
        http = next(m.group(1) for ln in seen if (m := re.match(r"  router .*http=(\S+)", ln)))
        certs = next(Path(m.group(1)) for ln in seen if (m := re.search(r"certificates in (\S+) ", ln)))
        yield Up(proc, seen, addrs, http, certs)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def tls_as(up: Up, role: str) -> TLSConfig:
    return TLSConfig(tls_cert=str(up.certs / f"{role}.pem"), tls_key=str(up.certs / f"{role}-key.pem"),
                     tls_ca=str(up.certs / "ca.pem"))


def health(address: str, channel: Callable[[], grpc.aio.Channel] | None) -> tuple[grpc.StatusCode, str]:
    """grpc.health.v1 Check over ``channel()`` (made inside the call's loop), or a plaintext channel."""
    async def call() -> None:
        async with (channel() if channel is not None else grpc.aio.insecure_channel(address)) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return rpc_code(call)


def victim_text(up: Up) -> str:
    status, body = post_json(up.http, "/v1/chat/completions", {
        "model": served_model(up.http), "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "user", "content": VICTIM}]})
    assert status == 200, body
    return body["choices"][0]["message"]["content"]


def test_default_up_says_mtls_and_warns_nothing(up: Up) -> None:
    assert set(up.grpc) >= {"router", "prefill-0", "decode-0", "kvstore"}, up.grpc
    assert up.certs.is_dir() and (up.certs.stat().st_mode & 0o777) == 0o700
    assert not any("--insecure-internal" in ln for ln in up.lines), up.lines


def test_no_certificate_is_refused_on_every_internal_port(up: Up) -> None:
    ca = (up.certs / "ca.pem").read_bytes()
    for name, address in up.grpc.items():
        code, _ = health(address, None)  # plaintext
        assert code == grpc.StatusCode.UNAVAILABLE, f"{name} answered a plaintext call ({code.name})"
        def anonymous(address: str = address) -> grpc.aio.Channel:
            return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca),
                                           options=[("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME)])
        code, _ = health(address, anonymous)  # TLS, the right CA, but no client certificate
        assert code == grpc.StatusCode.UNAVAILABLE, f"{name} answered a caller without a certificate ({code.name})"
        async_ok = health(address, lambda a=address: create_channel(a, tls=tls_as(up, "client")))
        assert async_ok[0] == grpc.StatusCode.OK, (name, async_ok)


def _put(address: str, tls: TLSConfig | None) -> grpc.StatusCode:
    data = b"forged page " * 64
    fp, h = "ab" * (FINGERPRINT_CHARS // 2), b"\x07" * HASH_SIZE

    async def call() -> None:
        async with create_channel(address, tls=tls) as ch:
            await kvstore_pb2_grpc.KVStoreStub(ch).Put(iter(split_page(fp, h, data, zlib.crc32(data))), timeout=20)
    return rpc_code(call)[0]


def _reserve_and_push(address: str, reserve_as: TLSConfig, push_as: TLSConfig | None
                      ) -> tuple[grpc.StatusCode, grpc.StatusCode | None]:
    """Reserve the victim's prompt tokens, then push forged pages into that reservation."""
    codes: list[grpc.StatusCode | None] = [None, None]

    async def run() -> None:
        async with create_channel(address, tls=reserve_as) as ch:
            try:
                resv = await decode_pb2_grpc.DecodeStub(ch).Reserve(decode_pb2.ReserveRequest(
                    request_id="forger", token_ids=list(range(1, 40)), lease_ms=2000,
                    params=common_pb2.SamplingParams(max_tokens=1)), timeout=20)
                codes[0] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                codes[0] = e.code()
                return
        n = len(resv.block_ids) - resv.num_cached_blocks

        async def forged() -> AsyncIterator[common_pb2.KVChunk]:
            for i in range(n):
                b = resv.num_cached_blocks + i
                yield common_pb2.KVChunk(
                    request_id="forger", reservation_id=resv.reservation_id, chunk_index=i, first_block=b,
                    num_pages=1, token_start=b * 16, token_end=min((b + 1) * 16, 39),
                    layout_fingerprint=resv.layout.fingerprint, payload=b"\0" * 16, transport="grpc",
                    reservation_token=resv.reservation_token, is_last=i == n - 1,
                    total_chunks=n if i == n - 1 else 0, first_token=1 if i == n - 1 else 0)
        async with create_channel(address, tls=push_as) as ch:
            try:
                await decode_pb2_grpc.DecodeStub(ch).PushKV(forged(), timeout=20)
                codes[1] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                codes[1] = e.code()
    asyncio.run(run())
    return codes[0], codes[1]  # type: ignore[return-value]


def test_forged_pages_are_refused_and_the_victim_answer_is_unchanged(up: Up) -> None:
    before = victim_text(up)
    kvstore, decode = up.grpc["kvstore"], up.grpc["decode-0"]
    assert _put(kvstore, None) == grpc.StatusCode.UNAVAILABLE  # no certificate
    for role in ("client", "router", "decode"):  # certified, but not a prefill
        assert _put(kvstore, tls_as(up, role)) == grpc.StatusCode.PERMISSION_DENIED, role
    # Reserve is the router's: a client (or prefill) certificate cannot take a reservation.
    assert _reserve_and_push(decode, tls_as(up, "client"), None)[0] == grpc.StatusCode.PERMISSION_DENIED
    # A router may reserve, but pages come only from a prefill: its push is refused, and so is a cert-less one.
    assert _reserve_and_push(decode, tls_as(up, "router"), tls_as(up, "router")) == (
        grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED)
    assert _reserve_and_push(decode, tls_as(up, "router"), None) == (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)
    assert victim_text(up) == before


def test_stopping_removes_the_certificates(up: Up) -> None:
    os.killpg(up.proc.pid, signal.SIGTERM)
    assert up.proc.wait(90) == 0, "\n".join(up.lines[-40:])
    assert not up.certs.exists()
