"""``grpc`` transport: the PushKV client stream; page bytes ride inside it (works everywhere).

It is also the descriptor stream of every side transport (shm, cuda-ipc, mooncake): a claim first,
then one descriptor per chunk, no payload.

Page bytes are copied once between the page tensor and gRPC: a message is serialized as its header
(every field but ``payload``) followed by the payload field written by hand from a memoryview of the
pages (protobuf allows fields in any order). Several messages are in flight: gRPC pulls them from a
bounded queue (a request iterator: several times faster than call.write) while the next chunk is
packed and checksummed.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, create_channel, detail_of, rpc_error_summary
from services.common.pb import common_pb2, decode_pb2
from services.common.tls import TLSConfig
from services.engine.kv_transport.base import CLAIM_ACK, KVPoll, KVSender, KVTransport, TransferError

PUSH_KV = "/pdserve.v1.Decode/PushKV"
_PAYLOAD_TAG = bytes([(10 << 3) | 2])
"""KVChunk.payload: field 10, wire type 2 (length-delimited)."""
CHANNELS_PER_PEER = 2
"""Default TCP connections kept to each decode (concurrent requests' streams take turns on them)."""
IN_FLIGHT = 4
"""Messages queued for the writer task at once (bounds host memory held by unsent chunks)."""
_END = object()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def serialize(msg: common_pb2.KVChunk | tuple[common_pb2.KVChunk, memoryview | bytes]) -> bytes:
    """A KVChunk, or (header, payload): the header's bytes then the payload field, in one copy."""
    if isinstance(msg, common_pb2.KVChunk):
        return msg.SerializeToString()
    header, payload = msg
    if not len(payload):
        return header.SerializeToString()
    return b"".join((header.SerializeToString(), _PAYLOAD_TAG, _varint(len(payload)), payload))


def _refused(e: grpc.aio.AioRpcError) -> TransferError:
    """What decode answered (or UNAVAILABLE when it could not be reached), with its typed detail."""
    return TransferError(f"decode refused KV: {rpc_error_summary(e)}", e.code(), detail_of(e))


CALL_END_TIMEOUT_S = 30.0
"""Longest wait for a failing PushKV call's final status before it is cancelled (seconds)."""


class _GrpcSender(KVSender):
    def __init__(self, channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> None:
        super().__init__()
        method = channel.stream_unary(PUSH_KV, request_serializer=serialize,
                                      response_deserializer=decode_pb2.PushKVResponse.FromString)
        self._queue: asyncio.Queue = asyncio.Queue(maxsize=IN_FLIGHT)
        # A request iterator, not call.write(): gRPC's consumer pulls messages at several times the rate.
        self._call = method(self._messages(), metadata=metadata)
        self._call.add_done_callback(self._ended)
        self._watcher = asyncio.ensure_future(self._watch())

    def _ended(self, _call: object) -> None:
        # Runs when the RPC completes, however: a writer thread polling sees the stream gone at once.
        if self.state is not KVPoll.SUCCESS:
            self.state = KVPoll.FAILED

    async def _messages(self):
        while True:
            msg = await self._queue.get()
            if msg is _END:
                return
            yield msg

    async def _watch(self) -> None:
        """Ends when the call does (decode answered, refused, or the connection broke)."""
        with contextlib.suppress(BaseException):
            await self._call

    async def _wait(self, step: asyncio.Future) -> None:
        """Wait for ``step`` unless the call ends first; then raise what decode said."""
        await asyncio.wait({step, self._watcher}, return_when=asyncio.FIRST_COMPLETED)
        if step.done() and not step.cancelled() and step.exception() is None:
            return
        step.cancel()
        await self._raise_from_call()

    async def _raise_from_call(self) -> None:
        self.state = KVPoll.FAILED
        if not self._watcher.done():
            # The call is ending (decode refused, or the connection broke): wait for its status. Never
            # cancel the watcher while it awaits the call: cancelling a task that awaits a grpc.aio call
            # cancels the call itself, and decode's refusal would read as CANCELLED.
            await asyncio.wait({self._watcher}, timeout=CALL_END_TIMEOUT_S)
        if not self._call.done():
            self._call.cancel()
        try:
            await self._call
        except grpc.aio.AioRpcError as e:
            raise _refused(e) from e
        except asyncio.CancelledError:
            raise TransferError("KV stream cancelled", grpc.StatusCode.CANCELLED) from None
        raise TransferError("decode closed the KV stream early", grpc.StatusCode.INTERNAL)

    async def bootstrap(self, claim: common_pb2.KVChunk | None = None) -> None:
        if claim is not None:
            await self._wait(asyncio.ensure_future(self._queue.put(claim)))
            await self._wait(asyncio.ensure_future(self._call.initial_metadata()))
            md = await self._call.initial_metadata()
            if not all((k, v) in list(md or ()) for k, v in CLAIM_ACK):
                await self._raise_from_call()
        if self.state is KVPoll.FAILED:
            await self._raise_from_call()
        self.state = KVPoll.WAITING_FOR_INPUT

    async def send(self, chunk: common_pb2.KVChunk, payload: memoryview | bytes = b"") -> None:
        if self.state is KVPoll.FAILED or self._watcher.done():
            await self._raise_from_call()
        await self._wait(asyncio.ensure_future(self._queue.put((chunk, payload) if len(payload) else chunk)))
        self._count(len(payload))

    async def finish(self) -> decode_pb2.PushKVResponse:
        await self._wait(asyncio.ensure_future(self._queue.put(_END)))
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
        self._watcher.cancel()
        with contextlib.suppress(BaseException):
            await self._watcher


class GrpcStreamTransport(KVTransport):
    """``tls``: the service's TLSConfig when mTLS is on (channels present its certificate), else None.
    ``channels_per_peer``: TCP connections kept to each decode; requests' streams take turns on them, so
    concurrent transfers are not serialized on one connection."""

    name = "grpc"

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, channels_per_peer: int = CHANNELS_PER_PEER
                 ) -> None:
        self._channels: dict[str, list[grpc.aio.Channel]] = {}
        self._turn: dict[str, int] = {}
        self._metadata = metadata
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._per_peer = max(1, channels_per_peer)

    def channel(self, address: str) -> grpc.aio.Channel:
        chans = self._channels.setdefault(address, [])
        turn = self._turn.get(address, 0)
        self._turn[address] = turn + 1
        if len(chans) < self._per_peer:
            # A distinct channel argument keeps gRPC from sharing one subchannel (connection) among them.
            chans.append(create_channel(address, tls=self._tls, max_message_bytes=self._max_message_bytes,
                                        options=(("grpc.channel_id", len(chans)),)))
            return chans[-1]
        return chans[turn % len(chans)]

    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        return _GrpcSender(self.channel(decode_address), (*self._metadata, *metadata))

    async def close(self) -> None:
        for chans in self._channels.values():
            for ch in chans:
                await ch.close()
        self._channels.clear()
