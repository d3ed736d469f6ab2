"""The transport interface: explicit states, one sender per request, a receiver on decode.

Two planes. The **descriptor stream** (``KVChunk`` messages over PushKV: request, chunk index, token
range, fingerprint, codec, checksum, first token) always goes to decode's receiver; a
:class:`KVSender` owns it. The **page bytes** ride inside those messages (``grpc``) or are written
straight into decode's pool by a :class:`PageWriter` (``shm``, ``cuda-ipc``, ``mooncake``) before the
message describing them is sent.

A writer may touch decode's pool only while decode knows it does: the sender first sends a
:class:`~common_pb2.KVClaim` (token, block ids, pool) and waits for decode's acknowledgement
(:meth:`KVSender.bootstrap`); decode then holds the reservation's blocks until the stream ends, and
the writer stops as soon as the stream breaks (:meth:`KVSender.poll` reads ``FAILED``).

States (SGLang's KVPoll): BOOTSTRAPPING (stream opening, claim not yet acknowledged) ->
WAITING_FOR_INPUT (ready, nothing sent) -> TRANSFERRING -> SUCCESS | FAILED.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

import grpc

from services.common.pb import common_pb2, decode_pb2
from services.engine.kv_layout import HeadSplitSpec, PageLayout

_E = TypeVar("_E", bound=BaseException)

CLAIM_ACK = (("pdserve-kv-claim", "ok"),)
"""Initial metadata decode sends once it accepted a stream's claim (the writer may write from then on)."""


class KVPoll(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"            # stream opening; a claim not yet acknowledged
    WAITING_FOR_INPUT = "waiting_for_input"    # ready; no chunk sent yet
    TRANSFERRING = "transferring"              # at least one chunk sent, the last not yet acknowledged
    SUCCESS = "success"                        # decode acknowledged the last chunk
    FAILED = "failed"                          # the stream broke or decode refused a chunk


class TransferError(RuntimeError):
    """The handoff failed. ``code`` is the status decode answered with (UNAVAILABLE when it could not be
    reached); ``detail`` the ErrorDetail it attached, if any."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                 detail: common_pb2.ErrorDetail | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.detail = detail


class ClaimUnanswered(TransferError):
    """Decode did not acknowledge a writer's claim within the claim wait of the prompt being computed: no page
    was written and decode keeps the reservation, so the request may be retried with it (a typed retry
    decision; the prefill's ClaimTimeout is one)."""


OnClaimed = Callable[[], Awaitable[None]]
"""Decode's acknowledgement of a claim (the servicer sends CLAIM_ACK as initial metadata)."""


class KVReceiver(Protocol):
    """Decode's side: consumes one request's chunk stream and acknowledges it."""

    async def receive(self, chunks: AsyncIterator[common_pb2.KVChunk],
                      on_claimed: OnClaimed | None = None) -> decode_pb2.PushKVResponse: ...


END_OF_STREAM = object()
"""Put on a sender's message queue after its last message: ``KVSender._messages_from`` ends there."""


class KVSender(abc.ABC):
    """Prefill's side for one request: ``bootstrap`` once, ``send`` each message, then ``finish``.

    ``poll()`` may be read from any thread (the engine thread reads it before every direct write)."""

    def __init__(self) -> None:
        self.state = KVPoll.BOOTSTRAPPING
        self.bytes_sent = 0
        self.chunks_sent = 0
        self.request_id = ""
        """The engine request id the stream was opened for (``KVTransport.open``)."""

    def poll(self) -> KVPoll:
        return self.state

    @abc.abstractmethod
    async def bootstrap(self, claim: common_pb2.KVChunk | None = None) -> None:
        """Open the stream. With ``claim`` (a message whose ``claim`` field is set), send it and return only
        once decode acknowledged it; raise TransferError if decode refused or went away."""

    @abc.abstractmethod
    async def send(self, chunk: common_pb2.KVChunk, payload: memoryview | bytes = b"", wire: bytes | None = None
                   ) -> None:
        """Queue one message; ``payload`` (the page bytes, when they ride in the stream) is attached
        as the message's payload field without an intermediate copy. ``wire``: the whole message, already
        laid out around ``payload`` (grpc_wire.MessageBuffer.seal); a stream of serialized messages sends it
        as it is."""

    @abc.abstractmethod
    async def finish(self) -> decode_pb2.PushKVResponse:
        """Close the stream after the last chunk; raise TransferError if decode refused or went away."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None: ...

    def _stream_ended(self, _stream: object) -> None:
        """Done-callback of the stream (a task or a call): ended before SUCCESS means FAILED, seen at once by a
        thread polling."""
        if self.state is not KVPoll.SUCCESS:
            self.state = KVPoll.FAILED

    @staticmethod
    async def _messages_from(queue: asyncio.Queue, end: object = END_OF_STREAM) -> AsyncIterator[object]:
        """The messages put on ``queue`` up to ``end``: the stream's request iterator, fed by ``send``."""
        while (item := await queue.get()) is not end:
            yield item

    async def _ended(self, response: Awaitable[decode_pb2.PushKVResponse], refused: type[_E],
                     as_error: Callable[[_E], TransferError]) -> decode_pb2.PushKVResponse:
        """``finish``'s tail: decode's answer on the closed stream sets SUCCESS; a ``refused`` exception sets
        FAILED and is raised as ``as_error(exc)`` (a TransferError carrying decode's status and detail)."""
        try:
            resp = await response
        except refused as e:
            self.state = KVPoll.FAILED
            raise as_error(e) from e
        self.state = KVPoll.SUCCESS
        return resp

    def _count(self, nbytes: int) -> None:
        self.state = KVPoll.TRANSFERRING
        self.chunks_sent += 1
        self.bytes_sent += nbytes


class PageWriter(abc.ABC):
    """Writes one request's pages straight into the reserved blocks of decode's pool (prefill side).

    ``write`` runs on the engine thread while the source blocks are held; it must not return before the
    pages are readable by decode, unless ``wait`` says when they are (then the descriptor is sent only
    after ``wait``). It raises TransferError once the request's stream is broken (nothing is written)."""

    transport: str = ""
    pool_id: str = ""
    """The pool written into, as decode names it (what the claim carries)."""
    sender: KVSender | None = None
    """The request's KV stream, set before the first write."""
    dest: list[int]
    """Decode's reserved block ids, in page order."""
    wire_codec: str = ""
    """Codec of the pages this writer moves ("": the pool's own dtype; FP8_CODEC after ``carry``)."""
    overlaps_compute: bool = False
    """True when ``write`` only starts the transfer and ``wait`` finishes it off the engine thread, so a
    chunk moves while the next one computes; the prefill tail rule (engine/prefill_tail.py) cuts only
    prompts streamed through such a writer."""
    splits: tuple[HeadSplitSpec, HeadSplitSpec] | None = None
    """(writer, pool) head splits when tensor-parallel ranks write per-rank head shards (parallel/rank_pages.py):
    named in the claim and in the layout fingerprint of every chunk; None: all heads into one pool."""

    def carry(self, layout: PageLayout) -> bool:
        """Move pages in ``layout``'s codec (a negotiated wire codec, e.g. fp8-e4m3) for this request; False
        when this writer writes the pool's own dtype only (shm, cuda-ipc, mooncake into the pool itself)."""
        return False

    def _broken(self) -> bool:
        """The request's KV stream failed (or was never set): no page may be written any more."""
        return self.sender is None or self.sender.poll() is KVPoll.FAILED

    def _check_write(self, first_block: int, num_pages: int) -> None:
        """Before a write: TransferError once the stream is broken (nothing may land that decode would not be
        told of), ValueError for pages outside the reserved blocks."""
        if self._broken():
            raise TransferError("KV stream to decode is broken: no page written", grpc.StatusCode.CANCELLED)
        if first_block + num_pages > len(self.dest):
            raise ValueError(f"pages [{first_block}, {first_block + num_pages}) outside the {len(self.dest)} "
                             "reserved blocks")

    @abc.abstractmethod
    def write(self, first_block: int, src_blocks: list[int]) -> object:
        """Engine thread: start writing src_blocks into dest blocks [first_block, first_block + n).
        Returns a handle for :meth:`wait`."""

    def wait(self, handle: object) -> None:
        """Worker thread: block until the write started by ``write`` has landed (default: it already has)."""
        return None

    def quiesce(self) -> None:
        """Worker thread: block until no write of this request is in flight (before its stream ends)."""
        return None

    def release_source(self) -> None:
        """Engine thread, after the last chunk's write: block until no write still reads the request's source
        blocks (they are freed after this step). Default: until every write has landed."""
        self.quiesce()


class KVTransport(abc.ABC):
    name: str = ""

    @abc.abstractmethod
    def open(self, decode_address: str, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> KVSender:
        """A sender for one request's chunks to the decode at ``decode_address`` (gRPC ``metadata`` rides
        along, e.g. trace context)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release channels and buffers."""
