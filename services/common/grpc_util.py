"""gRPC options, client channels, health polling and abort helpers shared by every service."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.pb import common_pb2
from services.common.tls import TLSConfig

MiB = 1 << 20
# Largest gRPC message either side accepts (bytes). KV chunks and kvstore page pieces are sized to fit
# under it: see payload_budget().
DEFAULT_MAX_MESSAGE_BYTES = 64 * MiB
# Headroom kept for the non-payload fields of a message carrying a bulk `bytes payload` (bytes).
MESSAGE_OVERHEAD_BYTES = 64 * 1024

# Keepalive: ping an idle connection every 30 s and drop it when no ack comes within 10 s, so a dead
# peer (pod gone, cable pulled) fails in-flight KV streams in under a minute instead of hanging.
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# Servers accept client pings this often (must be <= KEEPALIVE_TIME_MS or servers send GOAWAY).
MIN_PING_INTERVAL_MS = 10_000

Options = list[tuple[str, Any]]

# Trailing-metadata key of the serialized common_pb2.ErrorDetail that every pdserve failure carries.
ERROR_DETAIL_KEY = "pdserve-error-bin"
Reason = common_pb2.ErrorReason


def payload_budget(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> int:
    """Most payload bytes one KVChunk/Page message should carry under ``max_message_bytes``."""
    return max_message_bytes - MESSAGE_OVERHEAD_BYTES


def _common_options(max_message_bytes: int) -> Options:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Options:
    """Options for grpc.aio.server: message limits, keepalive, and no SO_REUSEPORT.

    SO_REUSEPORT is off so that binding a port another process already serves fails loudly instead of
    silently sharing it.
    """
    return [
        *_common_options(max_message_bytes),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Options:
    """Options for client channels, matching server_options."""
    return [
        *_common_options(max_message_bytes),
        ("grpc.enable_retries", 1),
    ]


def create_channel(address: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                   options: Sequence[tuple[str, Any]] = (), tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` ("host:port", "dns:///svc:port") with pdserve options.

    ``tls`` with mTLS on: the channel presents that certificate and verifies the server's against the
    CA and ``tls.tls_server_name``. ``options`` override the defaults key by key (gRPC core would keep
    the first of duplicate keys).
    """
    opts = merge_options(channel_options(max_message_bytes), options)
    if tls is not None and tls.tls_enabled:
        opts = merge_options(opts, [("grpc.ssl_target_name_override", tls.tls_server_name)])
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def merge_options(base: Sequence[tuple[str, Any]], overrides: Sequence[tuple[str, Any]]) -> Options:
    """``base`` with each key in ``overrides`` replaced (or added); one entry per key."""
    merged = dict(base)
    merged.update(overrides)
    return list(merged.items())


def service_name(pb2_module: ModuleType, name: str) -> str:
    """Fully qualified service name from a generated module: (decode_pb2, "Decode") -> "pdserve.v1.Decode"."""
    return str(pb2_module.DESCRIPTOR.services_by_name[name].full_name)


async def check_health(channel: grpc.aio.Channel, service: str = "", *, timeout_s: float = 1.0) -> int:
    """One grpc.health.v1 Check; returns the HealthCheckResponse.ServingStatus value."""
    stub = health_pb2_grpc.HealthStub(channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return int(resp.status)


async def wait_for_serving(address: str, timeout_s: float, *, service: str = "", interval_s: float = 0.1) -> None:
    """Poll ``address``'s health ``service`` ("" = whole server) until SERVING.

    Raises TimeoutError after ``timeout_s`` seconds, naming the last status or RPC error seen.
    """
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with create_channel(address) as channel:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{address} health {service or '<server>'} not SERVING after {timeout_s:.1f}s "
                                   f"(last: {last})")
            try:
                status = await check_health(channel, service, timeout_s=min(1.0, remaining))
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


_DEFAULT_REASON = {
    grpc.StatusCode.INVALID_ARGUMENT: (Reason.ERROR_REASON_INVALID_INPUT, False),
    grpc.StatusCode.OUT_OF_RANGE: (Reason.ERROR_REASON_INVALID_INPUT, False),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (Reason.ERROR_REASON_OVERLOADED, True),
    grpc.StatusCode.UNAVAILABLE: (Reason.ERROR_REASON_UNSPECIFIED, True),
    grpc.StatusCode.PERMISSION_DENIED: (Reason.ERROR_REASON_PERMISSION, False),
    grpc.StatusCode.UNAUTHENTICATED: (Reason.ERROR_REASON_PERMISSION, False),
    grpc.StatusCode.DEADLINE_EXCEEDED: (Reason.ERROR_REASON_DEADLINE, False),
    grpc.StatusCode.DATA_LOSS: (Reason.ERROR_REASON_DATA_LOSS, True),
    grpc.StatusCode.CANCELLED: (Reason.ERROR_REASON_CANCELLED, False),
}


def error_detail(reason: int, *, retryable: bool = False, side: str = "", field: str = "",
                 retry_after_ms: int = 0) -> common_pb2.ErrorDetail:
    return common_pb2.ErrorDetail(reason=reason, retryable=retryable, side=side, field=field,
                                  retry_after_ms=retry_after_ms)


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                detail: common_pb2.ErrorDetail | None = None) -> NoReturn:
    """Fail the RPC with ``code``, a message saying what and why, and a typed ErrorDetail in the
    trailing metadata (derived from ``code`` when not given). Never returns."""
    if detail is None:
        reason, retryable = _DEFAULT_REASON.get(code, (Reason.ERROR_REASON_UNSPECIFIED, False))
        detail = error_detail(reason, retryable=retryable)
    context.set_trailing_metadata(((ERROR_DETAIL_KEY, detail.SerializeToString()),))
    await context.abort(code, message)
    raise AssertionError("unreachable: context.abort returned")  # pragma: no cover


def detail_of(err: grpc.aio.AioRpcError) -> common_pb2.ErrorDetail:
    """The ErrorDetail a pdserve peer attached to ``err``; for a failure without one (connection refused,
    a peer that died mid-call, a deadline) one derived from the status code: UNAVAILABLE without a
    detail means the peer could not be reached, which is retryable elsewhere."""
    for key, value in err.trailing_metadata() or ():
        if key == ERROR_DETAIL_KEY and isinstance(value, bytes):
            d = common_pb2.ErrorDetail()
            try:
                d.ParseFromString(value)
                return d
            except DecodeError:  # a malformed detail reads as none
                break
    reason, retryable = _DEFAULT_REASON.get(err.code(), (Reason.ERROR_REASON_UNSPECIFIED, False))
    return error_detail(reason, retryable=retryable)


async def abort_invalid(context: grpc.aio.ServicerContext, what: str, why: str) -> NoReturn:
    """INVALID_ARGUMENT: ``what`` (a field or object) is wrong because ``why``."""
    await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {why}")


async def abort_not_found(context: grpc.aio.ServicerContext, what: str, key: str) -> NoReturn:
    """NOT_FOUND: e.g. ("reservation", "abc") -> "reservation 'abc' not found"."""
    await abort(context, grpc.StatusCode.NOT_FOUND, f"{what} {key!r} not found")


async def abort_if_draining(context: grpc.aio.ServicerContext, draining: asyncio.Event, service: str) -> None:
    """UNAVAILABLE when the service is shutting down, so clients retry elsewhere."""
    if draining.is_set():
        await abort(context, grpc.StatusCode.UNAVAILABLE, f"{service} is draining for shutdown; retry another instance",
                    error_detail(Reason.ERROR_REASON_DRAINING, retryable=True, side=service))


def rpc_error_summary(err: BaseException) -> str:
    """A one-line description of an RPC failure, for logs and wrapped errors."""
    if isinstance(err, grpc.aio.AioRpcError):
        return f"{err.code().name}: {err.details()}"
    return f"{type(err).__name__}: {err}"
