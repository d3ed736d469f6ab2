"""``grpc`` transport: page bytes ride inside the PushKV client stream (works everywhere)."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, create_channel, detail_of, rpc_error_summary
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.tls import TLSConfig
from services.engine.kv_transport.base import KVPoll, KVSender, KVTransport, TransferError

_END = object()


class _GrpcSender(KVSender):
    def __init__(self, stub: decode_pb2_grpc.DecodeStub, metadata: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=8)  # bounds host memory held by unsent chunks
        self._call = stub.PushKV(self._drain(self._queue, _END), metadata=metadata)
        self._watch = asyncio.ensure_future(self._call_done())

    async def send(self, chunk: common_pb2.KVChunk) -> None:
        if self.state == KVPoll.FAILED:
            raise TransferError("KV stream already failed", grpc.StatusCode.UNAVAILABLE)
        if self._call.done():
            await self._raise_from_call()
        put = asyncio.ensure_future(self._queue.put(chunk))
        await asyncio.wait({put, self._watch}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():  # decode ended the call while we waited for queue space
            put.cancel()
            await self._raise_from_call()
        self._count(chunk)

    async def _call_done(self) -> None:
        with contextlib.suppress(BaseException):
            await self._call

    async def _raise_from_call(self) -> None:
        self.state = KVPoll.FAILED
        try:
            await self._call
        except grpc.aio.AioRpcError as e:
            raise _refused(e) from e
        raise TransferError("decode closed the KV stream early", grpc.StatusCode.INTERNAL)

    async def finish(self) -> decode_pb2.PushKVResponse:
        await self._queue.put(_END)
        try:
            resp = await self._call
        except grpc.aio.AioRpcError as e:
            self.state = KVPoll.FAILED
            raise _refused(e) from e
        self.state = KVPoll.SUCCESS
        return resp

    async def abort(self, reason: str) -> None:
        self.state = KVPoll.FAILED
        self._call.cancel()
        self._watch.cancel()


def _refused(e: grpc.aio.AioRpcError) -> TransferError:
    """What decode answered (or UNAVAILABLE when it could not be reached), with its typed detail."""
    return TransferError(f"decode refused KV: {rpc_error_summary(e)}", e.code(), detail_of(e))


class GrpcStreamTransport(KVTransport):
    """``tls``: the service's TLSConfig when mTLS is on (channels present its certificate), else None."""

    name = "grpc"

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._metadata = metadata
        self._tls = tls
        self._max_message_bytes = max_message_bytes

    def stub(self, address: str) -> decode_pb2_grpc.DecodeStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = create_channel(address, tls=self._tls,
                                                          max_message_bytes=self._max_message_bytes)
        return decode_pb2_grpc.DecodeStub(ch)

    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        return _GrpcSender(self.stub(decode_address), (*self._metadata, *metadata))

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
