"""Decode's service registration with PushKV requests parsed header-only.

The generated ``add_DecodeServicer_to_server`` registers PushKV with ``KVChunk.FromString``, which
copies the page bytes out of gRPC's message twice (protobuf's parse, then reading ``payload``).
``add_decode_servicer`` registers the same servicer with ``grpc_wire.parse_chunk`` instead: the
header is parsed, the payload stays a read-only view into gRPC's bytes until DecodeKVReceiver copies
it into the KV pool (one copy after gRPC's own).
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from services.common.pb import decode_pb2_grpc
from services.engine.kv_transport.grpc_wire import parse_chunk

PUSH_KV = "PushKV"


class _PushKVHeaderOnly:
    """Stands in for the server inside the generated add_DecodeServicer_to_server: PushKV's request
    deserializer becomes parse_chunk (header parsed, payload a view), every other method is unchanged."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    @staticmethod
    def _swap(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        return h._replace(request_deserializer=parse_chunk)  # type: ignore[attr-defined]

    def add_generic_rpc_handlers(self, handlers: tuple[grpc.GenericRpcHandler, ...]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GenericPushKV(h, self._swap) for h in handlers))

    def add_registered_method_handlers(self, name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        swapped = {m: self._swap(h) if m == PUSH_KV else h for m, h in handlers.items()}
        self._server.add_registered_method_handlers(name, swapped)


class _GenericPushKV(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, swap: Callable[[grpc.RpcMethodHandler], grpc.RpcMethodHandler]
                 ) -> None:
        self._inner = inner
        self._swap = swap

    def service_name(self) -> str | None:
        name = getattr(self._inner, "service_name", None)
        return name() if name is not None else None

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        h = self._inner.service(details)
        if h is not None and details.method.rsplit("/", 1)[-1] == PUSH_KV:  # type: ignore[attr-defined]
            return self._swap(h)
        return h


def add_decode_servicer(servicer: decode_pb2_grpc.DecodeServicer, server: grpc.aio.Server) -> None:
    """Register the Decode service with PushKV messages parsed header-only: the page bytes stay a view
    into the received message until they are copied into the KV pool (see grpc_wire)."""
    decode_pb2_grpc.add_DecodeServicer_to_server(servicer, _PushKVHeaderOnly(server))
