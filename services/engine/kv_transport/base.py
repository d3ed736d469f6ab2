"""The transport interface: explicit states, one sender per request, a receiver on decode.

The descriptor stream (``KVChunk`` messages: request, chunk index, token range, fingerprint,
checksum, first token) always goes to the decode's receiver; a transport decides how the page
bytes travel (inside the messages, or written by a side channel before the descriptor is sent).
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from services.common.pb import common_pb2, decode_pb2


class KVPoll(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # opened, nothing sent yet
    TRANSFERRING = "transferring"    # at least one chunk sent, the last one not yet acknowledged
    SUCCESS = "success"              # decode acknowledged the last chunk
    FAILED = "failed"                # the stream broke or decode refused a chunk


class TransferError(RuntimeError):
    """The handoff failed. ``code`` is the status decode answered with (UNAVAILABLE when it could not be
    reached); ``detail`` the ErrorDetail it attached, if any."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 detail: common_pb2.ErrorDetail | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class KVReceiver(Protocol):
    """Decode's side: consumes one request's chunk stream and acknowledges it."""

    async def receive(self, chunks: AsyncIterator[common_pb2.KVChunk]) -> decode_pb2.PushKVResponse: ...


class KVSender(abc.ABC):
    """Prefill's side for one request. ``send`` queues; ``finish`` waits for decode's acknowledgement."""

    def __init__(self) -> None:
        self.state = KVPoll.BOOTSTRAPPING
        self.bytes_sent = 0
        self.chunks_sent = 0

    @abc.abstractmethod
    async def send(self, chunk: common_pb2.KVChunk) -> None: ...

    @abc.abstractmethod
    async def finish(self) -> decode_pb2.PushKVResponse:
        """Close the stream after the last chunk; raise TransferError if decode refused or went away."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None: ...

    @staticmethod
    async def _drain(queue: asyncio.Queue, end: object) -> AsyncIterator[common_pb2.KVChunk]:
        """The chunks put on ``queue`` until ``end``: the request stream a transport hands to decode."""
        while True:
            item = await queue.get()
            if item is end:
                return
            yield item

    def _count(self, chunk: common_pb2.KVChunk) -> None:
        self.state = KVPoll.TRANSFERRING
        self.chunks_sent += 1
        self.bytes_sent += len(chunk.payload)


class KVTransport(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        """A sender for one request's chunks to the decode at ``decode_address`` (gRPC ``metadata`` rides
        along, e.g. trace context)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release channels and buffers."""
