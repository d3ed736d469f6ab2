"""``grpc`` transport: the PushKV client stream; page bytes ride inside it (works everywhere).

It is also the descriptor stream of every side transport (shm, cuda-ipc, mooncake): a claim first,
then one descriptor per chunk, no payload.

Page bytes reach gRPC's message bytes with one copy. On CPU that copy is the export's gather: the pages
are gathered straight into the message, and its header written in front of them (``wire``,
grpc_wire.MessageBuffer). Host pages of a GPU export are copied in a worker thread: a message is
serialized as its header (every field but ``payload``) followed by the payload field written by hand from
a memoryview of the pages (grpc_wire.serialize). Several messages are in flight: gRPC
pulls them from a bounded queue (a request iterator: several times faster than call.write) while the
next chunk is packed, checksummed and serialized. (gRPC Python 1.85 then copies each message once more
into its own buffer, on the event loop; decode parses the header only, see grpc_wire.parse_chunk.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, create_channel, detail_of, rpc_error_summary
from services.common.pb import common_pb2, decode_pb2
from services.common.tls import TLSConfig
from services.engine.kv_transport.base import CLAIM_ACK, KVPoll, KVSender, KVTransport, TransferError
from services.engine.kv_transport.grpc_wire import serialize

PUSH_KV = "/pdserve.v1.Decode/PushKV"
CHANNELS_PER_PEER = 2
"""Default TCP connections kept to each decode (concurrent requests' streams take turns on them)."""
MAX_PEERS = 64
"""Default decodes whose channels are kept open at once; the least recently used one beyond it is
closed (once the streams on it have ended)."""
IN_FLIGHT = 4
"""Messages queued for the writer task at once (bounds host memory held by unsent chunks)."""
_END = object()


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
        self._call = method(self._messages_from(self._queue, _END), metadata=metadata)
        self._call.add_done_callback(self._stream_ended)
        self._watcher = asyncio.ensure_future(self._watch())

    def on_call_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once when the PushKV call ends, however it ends."""
        self._call.add_done_callback(lambda _call: fn())

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

    async def send(self, chunk: common_pb2.KVChunk, payload: memoryview | bytes = b"", wire: bytes | None = None
                   ) -> None:
        if self.state is KVPoll.FAILED or self._watcher.done():
            await self._raise_from_call()
        msg: common_pb2.KVChunk | bytes = chunk if wire is None else wire
        if wire is None and len(payload):
            # The one copy of the pages into the message, in a worker: the event loop (where gRPC copies the
            # previous message into its own buffer) keeps running meanwhile.
            msg = await asyncio.to_thread(serialize, (chunk, payload))
        await self._wait(asyncio.ensure_future(self._queue.put(msg)))
        self._count(len(payload))

    async def finish(self) -> decode_pb2.PushKVResponse:
        await self._wait(asyncio.ensure_future(self._queue.put(_END)))
        return await self._ended(self._call, grpc.aio.AioRpcError, _refused)

    async def abort(self, reason: str) -> None:
        self.state = KVPoll.FAILED
        self._call.cancel()
        self._watcher.cancel()
        with contextlib.suppress(BaseException):
            await self._watcher


@dataclass(eq=False)
class _Peer:
    """The channels kept to one decode."""

    channels: list[grpc.aio.Channel] = field(default_factory=list)
    turn: int = 0
    streams: int = 0
    """PushKV calls open on these channels (count)."""
    evicted: bool = False


class GrpcStreamTransport(KVTransport):
    """``tls``: the service's TLSConfig when mTLS is on (channels present its certificate), else None.
    ``channels_per_peer``: TCP connections kept to each decode; requests' streams take turns on them, so
    concurrent transfers are not serialized on one connection. ``max_peers``: decodes whose channels are
    kept (least recently used first out); an evicted decode's channels close once their last stream
    ends, and close() closes every channel this transport opened."""

    name = "grpc"

    def __init__(self, metadata: tuple[tuple[str, str], ...] = (), tls: TLSConfig | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, channels_per_peer: int = CHANNELS_PER_PEER,
                 max_peers: int = MAX_PEERS) -> None:
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self._evicted: set[_Peer] = set()
        """Evicted peers whose streams have not all ended yet."""
        self._closing: set[asyncio.Task] = set()
        self._metadata = metadata
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._per_peer = max(1, channels_per_peer)
        self._max_peers = max(1, max_peers)

    def _peer(self, address: str) -> _Peer:
        peer = self._peers.get(address)
        if peer is not None:
            self._peers.move_to_end(address)
            return peer
        peer = self._peers[address] = _Peer()
        while len(self._peers) > self._max_peers:
            _, old = self._peers.popitem(last=False)
            old.evicted = True
            if old.streams:
                self._evicted.add(old)
            else:
                self._close_later(old)
        return peer

    def _close_later(self, peer: _Peer) -> None:
        task = asyncio.ensure_future(asyncio.gather(*(ch.close() for ch in peer.channels)))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _stream_ended(self, peer: _Peer) -> None:
        peer.streams -= 1
        if peer.evicted and not peer.streams and peer in self._evicted:
            self._evicted.discard(peer)
            self._close_later(peer)

    def _channel(self, peer: _Peer, address: str) -> grpc.aio.Channel:
        turn, chans = peer.turn, peer.channels
        peer.turn += 1
        if len(chans) < self._per_peer:
            # A distinct channel argument keeps gRPC from sharing one subchannel (connection) among them.
            chans.append(create_channel(address, tls=self._tls, max_message_bytes=self._max_message_bytes,
                                        options=(("grpc.channel_id", len(chans)),)))
            return chans[-1]
        return chans[turn % len(chans)]

    def channel(self, address: str) -> grpc.aio.Channel:
        """A channel to ``address`` (the decode moves to the most recently used end of the cache)."""
        return self._channel(self._peer(address), address)

    @property
    def open_peers(self) -> list[str]:
        """Addresses whose channels are kept, least recently used first."""
        return list(self._peers)

    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        peer = self._peer(decode_address)
        sender = _GrpcSender(self._channel(peer, decode_address), (*self._metadata, *metadata))
        sender.request_id = request_id
        peer.streams += 1
        sender.on_call_done(lambda: self._stream_ended(peer))
        return sender

    async def close(self) -> None:
        peers = [*self._peers.values(), *self._evicted]
        self._peers.clear()
        self._evicted.clear()
        for peer in peers:
            peer.evicted = True
            self._close_later(peer)
        tasks = list(self._closing)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._closing.difference_update(tasks)
