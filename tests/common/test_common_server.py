"""services.common.server + grpc_util against a real grpc.aio server on ephemeral ports."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.grpc_util import (
    abort_if_draining,
    abort_invalid,
    create_channel,
    service_name,
    wait_for_serving,
)
from services.common.pb import common_pb2, common_pb2_grpc
from services.common.server import READY_PREFIX, ServerConfig, ServiceServer, serve

ADMIN = service_name(common_pb2, "Admin")
MiB = 1 << 20
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TinyAdmin(common_pb2_grpc.AdminServicer):
    def __init__(self, draining: asyncio.Event) -> None:
        self.draining = draining

    async def GetLoad(self, request: common_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> common_pb2.LoadReport:
        await abort_if_draining(context, self.draining, "test")
        return common_pb2.LoadReport(running=1, total_blocks=8, free_blocks=6, kv_usage=0.25)

    async def CaptureTrace(self, request: common_pb2.CaptureTraceRequest,
                           context: grpc.aio.ServicerContext) -> common_pb2.CaptureTraceResponse:
        if request.duration_s < 0:
            await abort_invalid(context, "duration_s", f"must be >= 0, got {request.duration_s}")
        return common_pb2.CaptureTraceResponse(path=request.out_dir, service="test")


def make_config(**kw: object) -> ServerConfig:
    base: dict[str, object] = dict(host="127.0.0.1", port=0, metrics_host="127.0.0.1", metrics_port=0,
                                   max_message_bytes=MiB, drain_timeout_s=2.0, grace_s=0.5)
    base.update(kw)
    return ServerConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
async def server() -> AsyncIterator[ServiceServer]:
    srv = ServiceServer("test", make_config())
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, TinyAdmin(srv.draining))
    await srv.start()
    yield srv
    await srv.shutdown("test teardown", force=True)


async def health_status(channel: grpc.aio.Channel, service: str = "") -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
    return int(resp.status)


async def test_health_not_serving_until_ready(server: ServiceServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert server.service_names == [ADMIN]
    async with create_channel(server.grpc_address) as ch:
        assert await health_status(ch) == NOT_SERVING
        assert await health_status(ch, ADMIN) == NOT_SERVING
        with pytest.raises(TimeoutError, match="NOT_SERVING"):
            await wait_for_serving(server.grpc_address, 0.3)
        await server.set_serving()
        await wait_for_serving(server.grpc_address, 5)
        await wait_for_serving(server.grpc_address, 5, service=ADMIN)
        assert await health_status(ch, ADMIN) == SERVING
        load = await common_pb2_grpc.AdminStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=2)
        assert load.running == 1 and load.kv_usage == pytest.approx(0.25)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(READY_PREFIX)]
    assert len(lines) == 1
    fields = dict(part.split("=", 1) for part in lines[0].split()[1:])
    assert fields["service"] == "test" and fields["grpc"] == f"127.0.0.1:{server.grpc_port}"
    assert fields["metrics"] == f"127.0.0.1:{server.metrics_port}" and fields["pid"] == str(os.getpid())


async def test_reflection_lists_services(server: ServiceServer) -> None:
    async with create_channel(server.grpc_address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        call = stub.ServerReflectionInfo(iter([
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=ADMIN),
        ]))
        responses = [r async for r in call]
    names = {s.name for s in responses[0].list_services_response.service}
    assert {ADMIN, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert responses[1].file_descriptor_response.file_descriptor_proto


async def test_oversize_message_rejected(server: ServiceServer) -> None:
    await server.set_serving()
    # The client may send 64 MiB; the server (max_message_bytes=1 MiB) must refuse a 2 MiB request.
    async with create_channel(server.grpc_address) as ch:
        stub = common_pb2_grpc.AdminStub(ch)
        ok = await stub.CaptureTrace(common_pb2.CaptureTraceRequest(out_dir="x" * (MiB // 2)), timeout=5)
        assert ok.service == "test"
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.CaptureTrace(common_pb2.CaptureTraceRequest(out_dir="x" * (2 * MiB)), timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.CaptureTrace(common_pb2.CaptureTraceRequest(duration_s=-1), timeout=5)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "duration_s" in (bad.value.details() or "")


async def test_metrics_endpoint(server: ServiceServer) -> None:
    assert server.metrics_port
    body = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=5).read())
    assert b"python_info" in body or b"process_" in body


async def test_shutdown_sequence() -> None:
    events: list[str] = []
    address_box: list[str] = []

    async def drain() -> None:
        # The server still answers during drain: health is NOT_SERVING and new work is refused.
        async with create_channel(address_box[0]) as ch:
            events.append(f"drain health={await health_status(ch)}")
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await common_pb2_grpc.AdminStub(ch).GetLoad(common_pb2.GetLoadRequest(), timeout=2)
            events.append(f"drain getload={exc.value.code().name}")

    def free_device() -> None:
        events.append("on_shutdown")

    srv = ServiceServer("test", make_config(), drain=drain, on_shutdown=free_device)
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, TinyAdmin(srv.draining))
    await srv.start()
    address_box.append(srv.grpc_address)
    await srv.set_serving()
    await srv.shutdown("SIGTERM (test)")
    assert srv.draining.is_set() and srv.stopped.is_set()
    assert events == [f"drain health={NOT_SERVING}", "drain getload=UNAVAILABLE", "on_shutdown"]
    async with create_channel(srv.grpc_address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await health_status(ch)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    await srv.shutdown("again")  # idempotent


async def test_drain_is_bounded() -> None:
    async def stuck() -> None:
        await asyncio.sleep(3600)

    srv = ServiceServer("test", make_config(drain_timeout_s=0.2, grace_s=0.1), drain=stuck)
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, TinyAdmin(srv.draining))
    await srv.start()
    t0 = time.monotonic()
    await asyncio.wait_for(srv.shutdown(), timeout=5)
    assert time.monotonic() - t0 < 2


async def test_serve_with_sigterm(capsys: pytest.CaptureFixture[str]) -> None:
    warmed = asyncio.Event()
    shut: list[str] = []

    async def warmup() -> None:
        await asyncio.sleep(0.05)
        warmed.set()

    srv = ServiceServer("test", make_config(), on_shutdown=lambda: shut.append("freed"))
    srv.add_service(common_pb2_grpc.add_AdminServicer_to_server, TinyAdmin(srv.draining))
    task = asyncio.create_task(serve(srv, warmup=warmup))
    for _ in range(100):
        if srv.grpc_port:
            break
        await asyncio.sleep(0.02)
    await wait_for_serving(srv.grpc_address, 5)
    assert warmed.is_set()
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, timeout=10)
    assert shut == ["freed"] and srv.stopped.is_set()
    assert f"grpc=127.0.0.1:{srv.grpc_port}" in capsys.readouterr().out


async def test_port_in_use_fails_loudly(server: ServiceServer) -> None:
    other = ServiceServer("test2", make_config(port=server.grpc_port, metrics_port=-1))
    with pytest.raises(OSError, match="cannot bind gRPC"):
        await other.start()
    await other.shutdown(force=True)


async def test_channel_option_override(server: ServiceServer) -> None:
    await server.set_serving()
    # A 1 KiB client receive limit must beat the 64 MiB default: the 5000-byte echo is refused.
    async with create_channel(server.grpc_address, options=[("grpc.max_receive_message_length", 1024)]) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await common_pb2_grpc.AdminStub(ch).CaptureTrace(
                common_pb2.CaptureTraceRequest(out_dir="y" * 5000), timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class _Writes:
    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass


async def test_the_ready_line_leaves_in_one_write(server: ServiceServer, monkeypatch: pytest.MonkeyPatch) -> None:
    # Under the launcher stdout is unbuffered: a line written as text, then newline, can be split by another
    # thread's log line, and the launcher then reads a log timestamp as part of the pid.
    out = _Writes()
    monkeypatch.setattr("sys.stdout", out)
    await server.set_serving()
    ready = [w for w in out.writes if w.startswith(READY_PREFIX)]
    assert len(ready) == 1 and ready[0].endswith("\n") and ready[0].count("\n") == 1
    assert ready[0].rstrip("\n").split()[-1] == f"pid={os.getpid()}"
