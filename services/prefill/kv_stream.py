"""One request's KV pages from the engine thread to its sender, and the pump that sends them.

Engine thread (``on_chunk``, while the chunk's blocks are held): either a side transport's writer
starts writing the chunk's pages into decode's pool, or the page API starts exporting them to host
memory (a gather; on GPU an async copy on a side stream). Nothing else happens on the step loop, and
it never waits: when the last chunk is computed before decode acknowledged the writer's claim, the
request's blocks are held past its end (``LLMEngine.hold_blocks``) and its unwritten pages go to the
sender as a deferred write, issued on the engine thread once the claim is acknowledged. With the loop in an
engine-core process, "engine thread" reads "the event loop, as each step's chunks arrive" (engine_port.py): the
core steps again only once they were read, and holds every prompt's blocks past its last chunk until its last
pages are out (``release_held``).

Sender task (``pump``): waits for the write or the export in a worker thread, checksums the bytes
there, and sends one message per piece, and the next piece is prepared while the previous one is on the
wire. On CPU the export gathers the pages straight into the messages' bytes (``message_export``,
grpc_wire.MessageBuffer) and the pump writes each header in front of them: gRPC gets the pool's pages
after that one copy. Host pages of a GPU export are copied once more, into each message (a memoryview,
see grpc_wire.serialize).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import grpc
import torch

from services.common.pb import common_pb2
from services.engine.kv_layout import PageLayout, checksum
from services.engine.kv_pages import KVPages, MessageExport, PageExport
from services.engine.kv_transport import KVSender, TransferError
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.grpc_wire import MessageBuffer
from services.engine.scheduler import ScheduledChunk
from services.kv.claim import codec_pb
from services.prefill.engine_port import PrefillEngine
from services.prefill.kvstore_writeback import WriteBackSpan
from services.prefill.layer_export import armed, watch
from services.text.sampling_params import Sampled, TopLogprobs
from services.text.sampling_pb import top_to_pb

CRC_IN_THREAD_BYTES = 1 << 18
"""Payloads at least this large are checksummed in a worker thread (zlib releases the GIL)."""
MESSAGE_PAYLOAD_BYTES = 8 << 20
"""Most page bytes one grpc message carries (a chunk is split at page boundaries; at least one page).
Every message is a fresh buffer on each side (gRPC's and Python's copies); glibc recycles buffers of
this size, while ones above its 32 MiB mmap ceiling are mapped and page-faulted anew every time:
``pdserve bench kv`` measured 0.8-0.9 CPU s/GB per side at 6-8 MiB messages, 1.6 at 47 MiB."""


class ClaimTimeout(TransferError):
    """Decode did not acknowledge the writer's claim within ``claim_wait_s`` of the prompt being computed;
    no page was written and decode keeps the reservation, so the request may be retried with it."""


class AttachTimeout(ClaimTimeout):
    """An early request got no reservation within ``claim_wait_s`` of its prompt being computed: nothing was
    written, so another prefill may take the request with the reservation (retryable)."""


@dataclass
class PagesReady:
    first_block: int
    token_start: int
    token_end: int
    pages: PageExport | MessageExport | None
    """The chunk's pages on their way to the host (or, on CPU, already inside their messages); None when no
    page is due or when a side transport writes them (then num_pages says how many and ``write`` is its
    handle)."""
    num_pages: int = 0
    write: object = None
    deferred: list[int] | None = None
    """Source block ids of pages computed before decode acknowledged the claim: the sender issues their
    write once it has (``write`` is None until then); the blocks are held until that write landed."""
    last: bool = False
    first_token: int = 0
    first_logprob: float = 0.0
    first_top: TopLogprobs | None = None
    """Alternatives to first_token (when the request asked for top_logprobs)."""
    prefill_done_unix: float = 0.0


class RequestKVStream:
    """One request's pages, from the engine thread to the sender task."""

    def __init__(self, loop: asyncio.AbstractEventLoop, export: Callable[[list[int]], PageExport], block_size: int,
                 num_skip_blocks: int, chunked: bool, arrival: float, writer: PageWriter | None = None,
                 engine: PrefillEngine | None = None, claim_wait_s: float = 0.0, pending: bool = False,
                 writeback_begin: Callable[[list[int]], WriteBackSpan | str] | None = None) -> None:
        """``pending``: an early Prefill whose reservation is not known yet (``attach`` names it); until its
        claim is acknowledged every computed page is deferred exactly as for an unanswered writer claim."""
        self.loop = loop
        self.export = export
        """Starts a chunk's page export for the wire (the cache's dtype, or a codec such as fp8-e4m3)."""
        self.writeback_begin = writeback_begin
        """Engine thread, last chunk: takes a span of the kvstore write-back ring and starts the export of the pages
        due to the kvstore into it (KVStorePrefix.write_back_begin), or says why not (then nothing is copied)."""
        self.writeback: tuple[int, WriteBackSpan] | None = None
        """(first block, ring span) of the full blocks the kvstore lacks, once the last chunk is computed; the
        servicer hands it to the writer after the handoff, or gives the span back when the request failed."""
        self.writeback_skipped = ""
        """Why pages due to the kvstore were not exported (a kvstore-errors reason; counted by the servicer)."""
        self.writer = writer
        """Writes pages straight into decode's pool (shm, cuda-ipc, mooncake), or None."""
        self.block_size = block_size
        self.next_block = num_skip_blocks
        self.chunked = chunked
        self.queue: asyncio.Queue[PagesReady | BaseException] = asyncio.Queue()
        self.arrival = arrival
        self.first_scheduled: float | None = None
        self.last_computed: float | None = None
        self.num_chunks_computed = 0
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.hashes: list[bytes] = []
        self.writeback_from: int | None = None
        """Set when new full pages from this block on should go to the kvstore."""
        self.last_picked: float | None = None
        """When the sender task took the last chunk off the queue (monotonic seconds)."""
        self.engine = engine
        """Holds the request's blocks past its end for a deferred write (needed with a claim)."""
        self.claim_wait_s = claim_wait_s
        """Longest the sender waits for the claim's answer once a deferred write is due (seconds)."""
        self.claim_task: asyncio.Future[None] | None = None
        self.claim_ok = True
        """Pages may be written now: no claim was needed, or decode acknowledged it."""
        self.ending = False
        """The request is ending: with no acknowledged claim, nothing is written any more."""
        self.held_request: str | None = None
        """Engine request id whose blocks are held for the deferred write (None: none held)."""
        self.claim_answered: float | None = None
        """When decode acknowledged the writer's claim (monotonic seconds; None: no claim, or not yet)."""
        self.pending = pending
        self.num_skip_blocks = num_skip_blocks
        """Leading blocks decode holds: never sent (an early stream learns it at ``attach``)."""
        self.computed = asyncio.Event()
        """Set once the last chunk is computed or the stream failed (an early request's attach wait starts)."""
        if pending:
            self.claim_ok = False

    def claim(self, sender: KVSender, msg: common_pb2.KVChunk | None) -> asyncio.Future[None]:
        """Send the writer's claim (``msg``; None: open a byte stream, an early request without a writer)
        while the request is admitted and computed (not before): chunks computed before decode's answer are
        written with a later chunk, or by the sender as a deferred write once the answer came. The future
        raises decode's TransferError when it refused; the refusal also fails the stream at once, so the
        request stops computing and frees its blocks without waiting for its last chunk."""
        self.claim_ok = False
        watch(self, sender)  # its last chunk may leave layer group by layer group (layer_export.py)

        async def run() -> None:
            try:
                await sender.bootstrap(msg)
            except TransferError as e:
                self.fail(e)
                raise
            self.claim_answered = time.monotonic()
            self.claim_ok = True

        self.claim_task = asyncio.ensure_future(run())
        return self.claim_task

    def attach(self, writer: PageWriter | None, export: Callable[[list[int]], PageExport], num_skip_blocks: int
               ) -> None:
        """Event loop, before the claim is sent: an early request's reservation arrived. Safe while the engine
        thread runs ``on_chunk`` (no hop: a step computing the prompt may last the whole prefill): until the
        claim is acknowledged (``claim_ok``, set after this) on_chunk reads neither writer nor export and
        moves next_block only past the last chunk, and the sender trims a deferred last item to
        ``num_skip_blocks``; the first write after the acknowledgement starts at ``num_skip_blocks`` at the
        earliest."""
        self.writer = writer
        self.export = export
        self.num_skip_blocks = num_skip_blocks
        self.next_block = max(self.next_block, num_skip_blocks)
        self.pending = False

    def stop_waiting(self) -> None:
        """The request is ending: unless decode had acknowledged the claim, nothing is written any more."""
        self.ending = True

    # --- engine thread ---

    def on_chunk(self, ch: ScheduledChunk, sampled: Sampled | None, step_start: float) -> None:
        """``sampled``: what the last chunk sampled; None on the others."""
        done_mono, done_unix = time.monotonic(), time.time()  # the chunk is computed; reading its pages is transfer
        seq = ch.seq
        end = seq.num_computed_tokens + ch.num_new_tokens
        if self.first_scheduled is None:
            self.first_scheduled = step_start
            self.num_cached_tokens = seq.num_cached_tokens
        self.num_chunks_computed += 1
        self.num_computed_tokens += ch.num_new_tokens
        last = ch.sample
        try:
            if not self.chunked and not last:
                return
            bs = self.block_size
            limit = -(-end // bs) if last else end // bs
            first = self.next_block
            n = max(0, limit - first)
            item = PagesReady(first, first * bs, min(limit * bs, end) if n else first * bs, None, n)
            if not self._start_pages(ch, item, limit, last):
                return  # next_block stays: the first write after the claim's answer covers these pages
            self.next_block = max(self.next_block, limit)
            if last:
                self._last_item(item, ch, sampled, end, done_mono, done_unix)
            if item.num_pages or item.last:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            if last:  # after last_computed: a waiter seeing the event reads it set
                self.loop.call_soon_threadsafe(self.computed.set)
        except BaseException as e:  # surfaced to the request's task, not the engine loop
            self.fail(e)

    def _start_pages(self, ch: ScheduledChunk, item: PagesReady, limit: int, last: bool) -> bool:
        """Engine thread: start moving ``item``'s pages (blocks [item.first_block, limit) of the request): the
        writer's write (or the layer-group write armed for this chunk), or the page export; with a claim not yet
        answered, defer them instead. False when they wait for a later chunk (deferred, not the last)."""
        seq, first, n = ch.seq, item.first_block, item.num_pages
        write = armed(self, ch, first, limit) if n else None  # by layer group: sent once the claim is answered
        deferred = bool(n) and not self.claim_ok and write is None  # a writer's claim, or an early request's reservation
        if deferred and self.ending:
            raise TransferError("the request ended before decode acknowledged the KV claim; no page was "
                                "written", grpc.StatusCode.UNAVAILABLE)
        if deferred and not last:
            return False
        if deferred:  # never wait here: the blocks outlive the request until the sender wrote them
            assert self.engine is not None, "a claim needs the engine to hold the request's blocks"
            self.engine.hold(seq)
            self.held_request = seq.request_id
            item.deferred = list(seq.block_table[first:limit])
        elif n and self.writer is not None:
            item.write = write or self.writer.write(first, seq.block_table[first:limit])
        elif n:
            item.pages = self.export(seq.block_table[first:limit])
        if last and self.writer is not None and not deferred:
            self.writer.release_source()  # the request's blocks are freed after this step
        if last and not deferred and self.engine is not None and self.engine.holds_last_chunk:
            self.held_request = seq.request_id  # held by the engine core: freed once these pages are out
        return True

    def _last_item(self, item: PagesReady, ch: ScheduledChunk, sampled: Sampled | None, end: int, done_mono: float,
                   done_unix: float) -> None:
        """Engine thread: the last chunk's item carries the first token and the pages due to the kvstore."""
        self.last_computed = done_mono
        s = sampled if sampled is not None else Sampled(0)
        item.last, item.first_token, item.first_logprob, item.first_top = True, s.token, s.logprob or 0.0, s.top
        item.prefill_done_unix = done_unix
        full = end // self.block_size
        if self.writeback_from is not None and full > self.writeback_from and self.writeback_begin is not None:
            got = self.writeback_begin(ch.seq.block_table[self.writeback_from:full])
            if isinstance(got, str):
                self.writeback_skipped = got
            else:
                self.writeback = (self.writeback_from, got)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)
        self.loop.call_soon_threadsafe(self.computed.set)

    # --- sender task ---

    async def write_deferred(self, item: PagesReady) -> None:
        """Wait (asynchronously) for the claim's answer, drop the pages decode holds (an early request learnt
        ``num_skip_blocks`` after deferring them), then start the deferred write (``item.write``) or page
        export (``item.pages``) on the engine thread (stream order as for any write). Raises decode's refusal,
        or ClaimTimeout after ``claim_wait_s``."""
        assert self.claim_task is not None and self.engine is not None and item.deferred is not None
        try:
            await asyncio.wait_for(asyncio.shield(self.claim_task), self.claim_wait_s)
        except TimeoutError:
            raise ClaimTimeout(f"decode did not acknowledge the KV claim within {self.claim_wait_s:g} s "
                               "(--claim-wait-s) of the prompt being computed; no page was written",
                               grpc.StatusCode.UNAVAILABLE) from None
        skip = min(item.num_pages, max(0, self.num_skip_blocks - item.first_block))
        if skip:
            item.first_block += skip
            item.deferred = item.deferred[skip:]
            item.num_pages -= skip
            item.token_start = item.first_block * self.block_size
            if not item.num_pages:
                item.token_end = item.token_start
        if not item.num_pages:
            return
        if self.writer is not None:
            item.write = await self.engine.run(self.writer.write, item.first_block, item.deferred)
        else:
            item.pages = await self.engine.run(self.export, item.deferred)

    async def release_held(self) -> None:
        """The last pages landed (or are on the host): let the writer drop its source and free the held blocks
        (engine thread, or the engine core)."""
        engine, writer, rid = self.engine, self.writer, self.held_request
        if engine is None or rid is None:
            return
        await engine.release(rid, writer.release_source if writer is not None else None)
        self.held_request = None


def _bytes_view(pages: torch.Tensor) -> memoryview:
    """The pages' bytes without a copy (the view keeps the tensor alive)."""
    return memoryview(pages.contiguous().view(torch.uint8).reshape(-1).numpy())


async def _landed(pages: PageExport) -> torch.Tensor:
    """The exported pages on the host; the wait runs in a worker thread only while the copy is still in flight
    (a CPU export, or a GPU copy already done, costs no thread hand-off)."""
    if pages.done is None or pages.done.query():
        return pages.wait()
    return await asyncio.to_thread(pages.wait)


async def _crc(payload: memoryview) -> int:
    if len(payload) >= CRC_IN_THREAD_BYTES:
        return await asyncio.to_thread(checksum, payload)
    return checksum(payload)


async def pump(stream: RequestKVStream, sender: KVSender, request_id: str, reservation_id: str,
               reservation_token: bytes, layout: PageLayout, max_payload_bytes: int, transport: str
               ) -> tuple[PagesReady, int]:
    """Send the stream's pages until the last chunk; returns the last item (first token) and the
    page bytes handed over (in messages or written directly). Every message carries the reservation's
    decode-issued token and the codec of its pages."""
    header = _Header(request_id, reservation_id, reservation_token, layout, transport, codec_pb(layout.target_codec))
    pages_per_msg = pages_per_message(max_payload_bytes, layout.page_bytes)
    page_bytes = 0
    index = 0
    while True:
        item = await _next_item(stream)
        page_bytes += item.num_pages * layout.page_bytes
        data, pieces = await _pieces(stream, item, pages_per_msg)
        index = await _send(sender, header, item, data, pieces, index)
        if item.last:
            return item, page_bytes


@dataclass
class _Header:
    """What every message of one request's stream carries."""

    request_id: str
    reservation_id: str
    reservation_token: bytes
    layout: PageLayout
    transport: str
    codec: int

    def chunk(self, item: PagesReady, index: int, off: int, cnt: int, crc: int) -> common_pb2.KVChunk:
        """The descriptor of ``cnt`` pages from ``item``'s page ``off`` on (message ``index`` of the stream)."""
        bs = self.layout.block_size
        first_block = item.first_block + off
        return common_pb2.KVChunk(
            request_id=self.request_id, reservation_id=self.reservation_id, chunk_index=index,
            token_start=first_block * bs,
            token_end=min((first_block + cnt) * bs, item.token_end) if cnt else item.token_start,
            first_block=first_block, num_pages=cnt, layout_fingerprint=self.layout.fingerprint,
            checksum=crc, transport=self.transport, reservation_token=self.reservation_token, codec=self.codec)


async def _next_item(stream: RequestKVStream) -> PagesReady:
    """The engine thread's next item (a failure it queued is raised); a deferred write is issued first."""
    item = await stream.queue.get()
    if isinstance(item, BaseException):
        raise item
    if item.last:
        stream.last_picked = time.monotonic()
    if item.deferred is not None:
        await stream.write_deferred(item)
    return item


Pieces = list[tuple[int, int, MessageBuffer | None]]
"""An item cut into messages: (first page, pages, the message gathered around them on CPU or None)."""


async def _pieces(stream: RequestKVStream, item: PagesReady, pages_per_msg: int) -> tuple[memoryview, Pieces]:
    """Wait for the item's pages (exported to the host, gathered into their messages, or written by the side
    transport: then one descriptor once they landed) and cut them into messages."""
    n = item.num_pages
    data = memoryview(b"")
    messages: list[tuple[int, MessageBuffer]] | None = None
    if isinstance(item.pages, MessageExport):  # gathered into the messages that carry them
        messages = item.pages.pieces
    elif item.pages is not None:
        data = _bytes_view(await _landed(item.pages))
    elif n and stream.writer is not None:  # written by a side transport: one descriptor once it landed
        if item.write is not None:
            await asyncio.to_thread(stream.writer.wait, item.write)
        pages_per_msg = max(1, n)
    if item.last:  # a deferred write's blocks, or every last chunk's with an engine core
        await stream.release_held()
    if messages is not None:
        offsets = accumulate((cnt for cnt, _ in messages), initial=0)  # one more than messages
        return data, [(o, cnt, buf) for o, (cnt, buf) in zip(offsets, messages, strict=False)] or [(0, 0, None)]
    return data, [(o, min(pages_per_msg, n - o), None) for o in range(0, n, pages_per_msg)] or [(0, 0, None)]


async def _send(sender: KVSender, header: _Header, item: PagesReady, data: memoryview, pieces: Pieces, index: int
                ) -> int:
    """One message per piece (the item's last one carries the first token when the item is the last); returns
    the next message index."""
    pb = header.layout.page_bytes
    for k, (off, cnt, buf) in enumerate(pieces):
        if buf is not None:
            payload = buf.payload
        else:
            payload = data[off * pb:(off + cnt) * pb] if len(data) else data
        msg = header.chunk(item, index, off, cnt, await _crc(payload))
        if item.last and k == len(pieces) - 1:
            _mark_last(msg, item, index)
        await sender.send(msg, payload, buf.seal(msg) if buf is not None else None)
        index += 1
    return index


def _mark_last(msg: common_pb2.KVChunk, item: PagesReady, index: int) -> None:
    """The stream's last message: the first token (its logprob and alternatives) and the message count."""
    msg.is_last = True
    msg.first_token = item.first_token
    msg.first_logprob = item.first_logprob
    if item.first_top is not None:
        msg.first_top_logprobs.CopyFrom(top_to_pb(item.first_top))
    msg.prefill_done_unix = item.prefill_done_unix
    msg.total_chunks = index + 1


def pages_per_message(max_payload_bytes: int, page_bytes: int) -> int:
    """Pages one grpc message carries (at least one)."""
    return max(1, min(max_payload_bytes, MESSAGE_PAYLOAD_BYTES) // page_bytes)


HEADER_ROOM_LIMIT = 32 << 10
"""Most bytes left in front of a message's pages for its header (payload_budget leaves 64 KiB)."""


def header_room(request_id: str, reservation_id: str, reservation_token: bytes, layout: PageLayout,
                transport: str, top_logprobs: int) -> int:
    """Bytes any KVChunk header of this request fits in: every field set, each number at its longest
    encoding, ``top_logprobs`` alternatives, plus the payload field's tag and length and the shortest padding;
    rounded up to 64 (the pages start aligned within the message)."""
    k = max(0, top_logprobs)
    worst = common_pb2.KVChunk(
        request_id=request_id, reservation_id=reservation_id, chunk_index=0xFFFFFFFF, token_start=0xFFFFFFFF,
        token_end=0xFFFFFFFF, first_block=0xFFFFFFFF, num_pages=0xFFFFFFFF, layout_fingerprint=layout.fingerprint,
        checksum=0xFFFFFFFF, transport=transport, is_last=True, first_token=-1, first_logprob=-1.0,
        prefill_done_unix=-1.0, total_chunks=0xFFFFFFFF, reservation_token=reservation_token,
        codec=max(common_pb2.KVCodec.values()),
        first_top_logprobs=common_pb2.TopLogprobs(token_ids=[-1] * k, logprobs=[-1.0] * k))
    return min(HEADER_ROOM_LIMIT, -(-(worst.ByteSize() + 16) // 64) * 64)


def message_export(pages: KVPages, layout: PageLayout, codec: str | None, max_payload_bytes: int, room: int
                   ) -> Callable[[list[int]], MessageExport]:
    """The grpc byte stream's export on CPU (``pages.exports_messages``): each piece of a chunk gathered
    straight into its own message (KVPages.export_messages), cut as ``pump`` cuts them."""
    per = pages_per_message(max_payload_bytes, layout.page_bytes)
    return lambda block_ids: pages.export_messages(block_ids, codec, per, room, layout.page_bytes)
