"""``fake`` transport: in-process handoff to a registered receiver, with fault injection for tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from services.common.pb import common_pb2, decode_pb2
from services.engine.kv_transport.base import (
    END_OF_STREAM,
    KVPoll,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
)


@dataclass
class Faults:
    fail_after_chunks: int = -1
    """Break the stream once this many chunks went through (-1: never)."""
    delay_s: float = 0.0
    """Sleep before each chunk (a slow link)."""
    corrupt_chunk: int = -1
    """Flip a payload byte of this chunk index (-1: none)."""


def _refused(exc: BaseException | None) -> TransferError:
    """A receiver's rejection as the TransferError the grpc transport would raise: its status code (a
    ``code`` attribute holding a grpc.StatusCode, else INTERNAL) and its ``detail`` ErrorDetail, if any."""
    code = getattr(exc, "code", None)
    detail = getattr(exc, "detail", None)
    return TransferError(f"decode refused KV: {exc}",
                         code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.INTERNAL,
                         detail if isinstance(detail, common_pb2.ErrorDetail) else None)


class _FakeSender(KVSender):
    def __init__(self, receiver: KVReceiver, faults: Faults) -> None:
        super().__init__()
        self._faults = faults
        self._queue: asyncio.Queue = asyncio.Queue()
        self._claimed = asyncio.Event()
        self._task = asyncio.ensure_future(receiver.receive(self._messages_from(self._queue), on_claimed=self._ack))
        self._task.add_done_callback(self._stream_ended)

    async def _ack(self) -> None:
        self._claimed.set()

    async def _raise(self) -> None:
        self.state = KVPoll.FAILED
        if not self._task.done():
            self._task.cancel()
            raise TransferError("KV stream cancelled", grpc.StatusCode.CANCELLED)
        raise _refused(None if self._task.cancelled() else self._task.exception())

    async def bootstrap(self, claim: common_pb2.KVChunk | None = None) -> None:
        if claim is not None:
            await self._queue.put(claim)
            ack = asyncio.ensure_future(self._claimed.wait())
            await asyncio.wait({ack, self._task}, return_when=asyncio.FIRST_COMPLETED)
            if not ack.done():
                ack.cancel()
                await self._raise()
        if self._task.done():
            await self._raise()
        self.state = KVPoll.WAITING_FOR_INPUT

    async def send(self, chunk: common_pb2.KVChunk, payload: memoryview | bytes = b"", wire: bytes | None = None
                   ) -> None:
        f = self._faults
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if self._task.done():
            await self._raise()
        if 0 <= f.fail_after_chunks <= self.chunks_sent:
            self.state = KVPoll.FAILED
            self._task.cancel()
            raise TransferError("injected transport failure", grpc.StatusCode.UNAVAILABLE)
        c = common_pb2.KVChunk()
        c.CopyFrom(chunk)
        if len(payload):
            c.payload = bytes(payload)
        if c.chunk_index == f.corrupt_chunk and c.payload:
            c.payload = bytes([c.payload[0] ^ 0xFF]) + c.payload[1:]
        await self._queue.put(c)
        self._count(len(payload))

    async def finish(self) -> decode_pb2.PushKVResponse:
        await self._queue.put(END_OF_STREAM)
        return await self._ended(self._task, Exception, _refused)

    async def abort(self, reason: str) -> None:
        self.state = KVPoll.FAILED
        self._task.cancel()


class FakeTransport(KVTransport):
    name = "fake"

    def __init__(self, receivers: dict[str, KVReceiver] | None = None, faults: Faults | None = None) -> None:
        self.receivers = receivers if receivers is not None else {}
        self.faults = faults or Faults()

    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        if decode_address not in self.receivers:
            raise TransferError(f"no fake receiver registered at {decode_address!r}", grpc.StatusCode.UNAVAILABLE)
        sender = _FakeSender(self.receivers[decode_address], self.faults)
        sender.request_id = request_id
        return sender

    async def close(self) -> None:
        self.receivers.clear()
