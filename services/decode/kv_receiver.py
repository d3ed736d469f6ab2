"""Decode's end of the KV handoff: checks every chunk, writes its pages into the paged cache.

Checks, in order (each failure is a :class:`KVRejected` with the gRPC status to answer):
known reservation, layout fingerprint, chunk order (no gap, no duplicate), page range inside the
reservation and not over blocks decode already holds, payload size, checksum. A rejected stream
frees the reservation: its KV can no longer be trusted. When the last chunk lands, every prompt
page must be present; then the request joins continuous batching.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from services.common.pb import common_pb2, decode_pb2
from services.decode.reservations import Reservation, ReservationTable
from services.engine.async_engine import AsyncEngine
from services.engine.kv_layout import FP8_CODEC, PageLayout, checksum

IN_PLACE_TRANSPORTS = frozenset({"shm", "cuda-ipc"})
"""Transports that write pages into this decode's pool themselves; their chunks carry descriptors only."""


class KVRejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        """Short label for the rejected-chunks metric."""


class DecodeKVReceiver:
    def __init__(self, engine: AsyncEngine, layout: PageLayout, table: ReservationTable,
                 wire_layouts: list[PageLayout] | None = None,
                 on_landed: Callable[[Reservation, common_pb2.KVChunk], None] | None = None,
                 on_rejected: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.layout = layout
        # Layouts a chunk may arrive in: the cache's own, plus codecs decoded on arrival (fp8-e4m3).
        self.layouts = {lay.fingerprint: lay for lay in [layout, *(wire_layouts or [])]}
        self.table = table
        self.on_landed = on_landed
        self.on_rejected = on_rejected
        runner = engine.engine.runner
        self._page_shape = (runner.num_layers, 2, runner.block_size, runner.num_kv_heads, runner.head_dim)
        self._dtype = runner.dtype
        self._runner = runner

    def _reject(self, code: grpc.StatusCode, message: str, reason: str) -> KVRejected:
        if self.on_rejected is not None:
            self.on_rejected(reason)
        return KVRejected(code, message, reason)

    def _check(self, r: Reservation, c: common_pb2.KVChunk) -> tuple[list[int], PageLayout]:
        """Validate one chunk against its reservation; returns the destination block ids and the layout
        the chunk's pages are in."""
        layout = self.layouts.get(c.layout_fingerprint)
        if layout is None:
            accepted = " or ".join(f"{fp} ({lay.describe()})" for fp, lay in self.layouts.items())
            raise self._reject(grpc.StatusCode.FAILED_PRECONDITION,
                               f"KV layout fingerprint mismatch: chunk has {c.layout_fingerprint or '(empty)'}, "
                               f"this decode expects {accepted}", "fingerprint")
        if c.chunk_index != r.next_chunk:
            what = "duplicate" if c.chunk_index < r.next_chunk else "out-of-order"
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"{what} KV chunk index {c.chunk_index}: expected {r.next_chunk}", "order")
        if c.token_end > r.prompt_len or c.token_start > c.token_end:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"KV chunk token range [{c.token_start}, {c.token_end}) is outside the prompt "
                               f"of {r.prompt_len} tokens", "range")
        first, n = c.first_block, c.num_pages
        if first < r.num_cached_blocks or first + n > len(r.block_ids):
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"KV chunk pages [{first}, {first + n}) fall outside the reserved pages "
                               f"[{r.num_cached_blocks}, {len(r.block_ids)})", "range")
        if c.transport not in IN_PLACE_TRANSPORTS:
            want = n * layout.page_bytes
            if len(c.payload) != want:
                raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"KV chunk payload is {len(c.payload)} bytes; {n} pages of "
                                   f"{layout.page_bytes} bytes ({layout.target_codec}) need {want}", "size")
        elif layout is not self.layout:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"transport {c.transport!r} writes pages in place: they must be in this decode's "
                               f"own layout {self.layout.fingerprint}", "fingerprint")
        return r.block_ids[first:first + n], layout

    def _verify_and_write(self, c: common_pb2.KVChunk, block_ids: list[int], layout: PageLayout) -> None:
        """Worker thread: checksum, then copy the pages into the cache (both release the GIL)."""
        got = checksum(c.payload)
        if got != c.checksum:
            raise self._reject(grpc.StatusCode.DATA_LOSS,
                               f"KV chunk {c.chunk_index} checksum mismatch: header says {c.checksum:#010x}, "
                               f"payload hashes to {got:#010x}", "checksum")
        if not block_ids:
            return
        fp8 = layout.target_codec == FP8_CODEC
        with warnings.catch_warnings():  # read-only view of the message's bytes: we only read it
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(c.payload, dtype=torch.uint8 if fp8 else self._dtype)
        if fp8:
            self._runner.write_pages(block_ids, flat.view(len(block_ids), layout.page_bytes), FP8_CODEC)
        else:
            self._runner.write_pages(block_ids, flat.view(len(block_ids), *self._page_shape))

    async def receive(self, chunks: AsyncIterator[common_pb2.KVChunk]) -> decode_pb2.PushKVResponse:
        r: Reservation | None = None
        received = 0
        # One chunk's checksum + page copy runs in a thread while the next chunk is read off the wire.
        pending: asyncio.Future | None = None
        try:
            async for c in chunks:
                if r is None:
                    r = self.table.get(c.reservation_id)
                    if r is None:
                        raise self._reject(grpc.StatusCode.NOT_FOUND,
                                           f"unknown reservation {c.reservation_id!r} (expired, aborted or never "
                                           "made)", "unknown_reservation")
                    if r.complete or r.receiving:
                        raise KVRejected(grpc.StatusCode.FAILED_PRECONDITION,
                                         f"reservation {r.reservation_id} already "
                                         f"{'has all its KV' if r.complete else 'has a KV stream open'}", "state")
                    r.receiving = True
                    r.next_chunk = 0  # a new stream (a retried prefill) starts over
                elif c.reservation_id != r.reservation_id:
                    raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                                       f"one PushKV stream carries one reservation: got {c.reservation_id!r} "
                                       f"after {r.reservation_id!r}", "order")
                block_ids, layout = self._check(r, c)
                if pending is not None:
                    await pending
                    pending = None
                if c.payload:
                    pending = asyncio.ensure_future(asyncio.to_thread(self._verify_and_write, c, block_ids, layout))
                r.pages_written.update(range(c.first_block, c.first_block + c.num_pages))
                r.next_chunk += 1
                # Page bytes landed, whichever way they came (in the message, or written by a side transport).
                r.bytes_received += len(c.payload) or c.num_pages * self.layout.page_bytes
                received += 1
                if c.is_last:
                    if pending is not None:
                        await pending
                        pending = None
                    await self._finish(r, c)
            if pending is not None:
                await pending
                pending = None
            if r is not None and not r.complete:
                raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"KV stream of {r.reservation_id} ended before its last chunk "
                                   f"({r.next_chunk} received)", "incomplete")
        except KVRejected:
            if r is not None and not r.complete:
                await self.release(r)
            raise
        finally:
            if pending is not None:  # the stream broke: let the last copy finish before the blocks can be reused
                await asyncio.gather(pending, return_exceptions=True)
            if r is not None:
                r.receiving = False
        return decode_pb2.PushKVResponse(chunks_received=received, bytes_received=r.bytes_received if r else 0)

    async def _finish(self, r: Reservation, c: common_pb2.KVChunk) -> None:
        if c.total_chunks and c.total_chunks != c.chunk_index + 1:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"last KV chunk says total_chunks={c.total_chunks} but is chunk {c.chunk_index}",
                               "order")
        missing = sorted(set(range(r.num_cached_blocks, len(r.block_ids))) - r.pages_written)
        if missing:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"last KV chunk arrived but pages {missing[:8]}{'...' if len(missing) > 8 else ''} "
                               "of the prompt never did", "incomplete")
        r.kv_done_at = time.monotonic()
        if r.lease is not None:
            r.lease.cancel()
            r.lease = None
        if self.on_landed is not None:
            self.on_landed(r, c)
        await self.engine.kv_import_done(r.reservation_id, c.first_token,
                                         c.first_logprob if r.params.logprobs else None)

    async def release(self, r: Reservation) -> None:
        """Free a reservation that will not run (rejected, expired, aborted)."""
        self.table.remove(r)
        await self.engine.abort(r.reservation_id)
