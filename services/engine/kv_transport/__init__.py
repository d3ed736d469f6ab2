"""KV transports: how a request's KV chunks move from prefill to decode (docs/ARCHITECTURE.md, "KV layout").

``grpc`` carries page bytes in the PushKV stream; ``shm`` / ``cuda-ipc`` (same host) and ``mooncake``
(any host) are page writers into decode's pool whose PushKV stream carries a claim and descriptors.
"""

from __future__ import annotations

from services.engine.kv_transport.base import (
    CLAIM_ACK,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransport,
    PageWriter,
    TransferError,
)
from services.engine.kv_transport.fake import FakeTransport
from services.engine.kv_transport.grpc_stream import GrpcStreamTransport

TRANSPORTS = {"grpc": GrpcStreamTransport, "fake": FakeTransport}
"""Descriptor-stream transports by name (page writers are chosen per request by the connectors of services/kv)."""


def make_transport(name: str, **kwargs) -> KVTransport:
    if name not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {sorted(TRANSPORTS)}")
    return TRANSPORTS[name](**kwargs)


__all__ = ["CLAIM_ACK", "TRANSPORTS", "FakeTransport", "GrpcStreamTransport", "KVPoll", "KVReceiver", "KVSender",
           "KVTransport", "PageWriter", "TransferError", "make_transport"]
