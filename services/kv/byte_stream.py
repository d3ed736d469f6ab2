"""``grpc``: page bytes inside the PushKV messages (the default, anywhere), and the in-process ``fake``.

Neither writes into decode's pool: the prefill side makes no writer (the pump exports each chunk's pages
into its messages, services/prefill/kv_stream.py), and decode copies a checked payload into its cache.
"""

from __future__ import annotations

from collections.abc import Awaitable

from services.engine.async_engine import EngineFront
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_transport.fake import FakeTransport
from services.engine.kv_transport.grpc_stream import GrpcStreamTransport
from services.kv.connector import Connector


class ByteStreamConnector(Connector):
    """Page bytes in the descriptor stream itself: ``descriptors`` is the KVTransport class carrying them."""

    def __init__(self, name: str, descriptors: type) -> None:
        self.name = name
        self.descriptors = descriptors

    def accept(self, engine: EngineFront, block_ids: list[int], layout: PageLayout, payload: bytes | memoryview,
               landing: object = None) -> Awaitable[None] | None:
        """The payload (checksummed by the receiver) into the cache, dequantized when it is fp8-e4m3."""
        if not block_ids:
            return None
        return engine.import_payload(block_ids, payload, layout.target_codec == FP8_CODEC)


GRPC = ByteStreamConnector("grpc", GrpcStreamTransport)
FAKE = ByteStreamConnector("fake", FakeTransport)
"""In-process, with fault injection (kv_transport/fake.py ``Faults``): for tests."""
