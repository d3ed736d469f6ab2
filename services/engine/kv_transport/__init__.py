"""KV transports: how a request's KV chunks move from prefill to decode (DESIGN section 5)."""

from __future__ import annotations

from services.engine.kv_transport.base import KVPoll, KVReceiver, KVSender, KVTransport, TransferError
from services.engine.kv_transport.fake import FakeTransport
from services.engine.kv_transport.grpc_stream import GrpcStreamTransport

TRANSPORTS = {"grpc": GrpcStreamTransport, "fake": FakeTransport}


def make_transport(name: str, **kwargs) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](**kwargs)


__all__ = ["TRANSPORTS", "FakeTransport", "GrpcStreamTransport", "KVPoll", "KVReceiver", "KVSender",
           "KVTransport", "TransferError", "make_transport"]
