"""KV connectors: every way a request's pages move from prefill's pool into decode's (docs/ARCHITECTURE.md,
"KV layout and transports").

``registry.py`` names them (grpc bytes, shm, cuda-ipc, mooncake direct and staged, tensor-parallel shard
writes, the fake); each connector (``connector.py``) has a prefill side (``probe`` a destination, make the
``PageWriter`` that writes and flushes each chunk) and a decode side (``offer`` a destination, ``accept`` a
chunk). ``planner.py`` picks a request's connector on prefill, ``offer.py`` decode's offer, ``claim.py``
holds the claim both sides share. The descriptor stream and its KVPoll states stay in
services/engine/kv_transport (the engine does not import this package).
"""

from __future__ import annotations

from services.engine.kv_transport.base import KVPoll, KVSender, KVTransport, PageWriter, TransferError
from services.kv.connector import Connector
from services.kv.registry import BY_NAME, CONNECTORS, Mode, by_name

__all__ = ["BY_NAME", "CONNECTORS", "Connector", "KVPoll", "KVSender", "KVTransport", "Mode", "PageWriter",
           "TransferError", "by_name"]
