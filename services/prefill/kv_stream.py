"""Prefill's side of the chunked KV handoff.

After the model computes a chunk (engine thread), :class:`RequestKVStream` packs the pages that
became complete into one host buffer and queues it; an asyncio task turns buffers into
``KVChunk`` messages (bytes, CRC-32, split under the message limit) and sends them while the next
chunk computes. With chunked transfer off, nothing is queued until the last chunk.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch

from services.common.pb import common_pb2
from services.engine.kv_layout import PageLayout, checksum
from services.engine.kv_transport import KVSender
from services.engine.scheduler import ScheduledChunk


@dataclass
class PagesReady:
    first_block: int
    token_start: int
    token_end: int
    pages: torch.Tensor | None
    """[P, layers, 2, block_size, kv_heads, head_dim] on the host; None when no page is due or when a
    side transport already wrote them (then num_pages says how many)."""
    num_pages: int = 0
    last: bool = False
    writeback: tuple[int, torch.Tensor] | None = None
    """(first block, pages) of full blocks the kvstore lacks, on the last item only."""
    first_token: int = 0
    first_logprob: float = 0.0
    prefill_done_unix: float = 0.0


class RequestKVStream:
    """One request's pages, from the engine thread to the sender task."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_pages, block_size: int, num_skip_blocks: int,
                 chunked: bool, arrival: float, write_direct=None, read_native=None) -> None:
        self.loop = loop
        self.read_pages = read_pages
        """Packs pages for the wire (the cache's dtype, or a codec such as fp8-e4m3)."""
        self.read_native = read_native or read_pages
        """Packs pages in the cache's own layout (what the kvstore keeps)."""
        self.write_direct = write_direct
        """``f(first_block, src_block_ids)``: write pages straight into decode's pool (shm), or None."""
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

    # --- engine thread ---

    def on_chunk(self, ch: ScheduledChunk, sampled: tuple[int, float | None] | None, step_start: float) -> None:
        done_mono, done_unix = time.monotonic(), time.time()  # the chunk is computed; reading its pages is transfer
        seq = ch.seq
        start = seq.num_computed_tokens
        end = start + ch.num_new_tokens
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
            pages = None
            first = self.next_block
            n = max(0, limit - first)
            if n and self.write_direct is not None:
                self.write_direct(first, seq.block_table[first:limit])
            elif n:
                pages = self.read_pages(seq.block_table[first:limit])
            self.next_block = max(self.next_block, limit)
            item = PagesReady(first, first * bs, min(limit * bs, end) if n else first * bs, pages, n)
            if last:
                self.last_computed = done_mono
                token, lp = sampled if sampled is not None else (0, None)
                item.last, item.first_token, item.first_logprob = True, token, lp or 0.0
                item.prefill_done_unix = done_unix
                full = end // bs
                if self.writeback_from is not None and full > self.writeback_from:
                    item.writeback = (self.writeback_from,
                                      self.read_native(seq.block_table[self.writeback_from:full]))
            if item.num_pages or item.last:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except BaseException as e:  # surfaced to the request's task, not the engine loop
            self.loop.call_soon_threadsafe(self.queue.put_nowait, e)

    def fail(self, exc: BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, exc)


def _encode(pages: torch.Tensor) -> bytes:
    return pages.contiguous().view(torch.uint8).numpy().tobytes()


async def pump(stream: RequestKVStream, sender: KVSender, request_id: str, reservation_id: str,
               reservation_token: bytes, layout: PageLayout, max_payload_bytes: int, transport: str
               ) -> tuple[PagesReady, int]:
    """Send the stream's pages until the last chunk; returns the last item (first token) and the
    page bytes handed over (in messages or written directly). Every message carries the reservation's
    decode-issued token."""
    pages_per_msg = max(1, max_payload_bytes // layout.page_bytes)
    page_bytes = 0
    index = 0
    while True:
        item = await stream.queue.get()
        if isinstance(item, BaseException):
            raise item
        n = item.num_pages
        page_bytes += n * layout.page_bytes
        if item.pages is None:  # written by a side transport already: one descriptor for all of it
            pages_per_msg = max(1, n)
        bs = layout.block_size
        pieces = [(o, min(pages_per_msg, n - o)) for o in range(0, n, pages_per_msg)] or [(0, 0)]
        for k, (off, cnt) in enumerate(pieces):
            payload = b""
            if cnt and item.pages is not None:
                payload = await asyncio.to_thread(_encode, item.pages[off:off + cnt])
            crc = await asyncio.to_thread(checksum, payload) if len(payload) > 1 << 20 else checksum(payload)
            first_block = item.first_block + off
            msg = common_pb2.KVChunk(
                request_id=request_id, reservation_id=reservation_id, chunk_index=index,
                token_start=first_block * bs,
                token_end=min((first_block + cnt) * bs, item.token_end) if cnt else item.token_start,
                first_block=first_block, num_pages=cnt, layout_fingerprint=layout.fingerprint,
                checksum=crc, payload=payload, transport=transport, reservation_token=reservation_token)
            if item.last and k == len(pieces) - 1:
                msg.is_last = True
                msg.first_token = item.first_token
                msg.first_logprob = item.first_logprob
                msg.prefill_done_unix = item.prefill_done_unix
                msg.total_chunks = index + 1
            await sender.send(msg)
            index += 1
        if item.last:
            return item, page_bytes
