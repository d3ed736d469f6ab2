"""Decode's end of the KV handoff: checks every chunk, writes its pages into the paged cache.

Checks, in order (each failure is a :class:`KVRejected` with the gRPC status and ErrorDetail reason
to answer): known reservation, its token (the decode-issued secret), layout fingerprint, chunk order
(no gap, no duplicate), token and page ranges inside the reservation and not over blocks decode
already holds, payload size, ``first_token`` inside the vocabulary, checksum.

What a failure does to the reservation:
  * a wrong token (or a second stream while one is open) changes nothing: a forger cannot cancel
    someone else's work;
  * a protocol violation (layout, order, range, size, checksum, pages missing at the last chunk)
    frees it: its KV can no longer be trusted;
  * a stream that breaks (the peer died: the iterator raises or is cancelled, or it ends without its
    last chunk) keeps it and forgets the stream's progress, so a retried prefill can send a fresh
    stream from chunk 0; its lease keeps running and frees it if no one comes.
When the last chunk lands, every prompt page must be present; then the request joins continuous
batching.

Side transports (shm, cuda-ipc, mooncake) start their stream with a claim: :mod:`services.kv.claim`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import KW_ONLY, dataclass

import grpc

from services.common.grpc_util import Reason
from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2
from services.decode.reservations import EndCause, Reservation, ReservationTable
from services.engine.async_engine import EngineDeadError, EngineFront
from services.engine.kv_layout import PageLayout, checksum
from services.engine.kv_transport.base import KVPoll, OnClaimed
from services.engine.kv_transport.grpc_wire import WireChunk
from services.engine.parallel.rank_pages import spec_of
from services.kv import registry
from services.kv.byte_stream import GRPC
from services.kv.claim import CODEC_OF, check_claim
from services.kv.mooncake import MOONCAKE_STAGED
from services.kv.offer import landing_for
from services.text.sampling_pb import top_from_pb

_END = object()


@dataclass(eq=False, repr=False)  # an exception: hashable, repr as raised
class KVRejected(Exception):
    """A KV message decode refuses, answered with ``code`` and a typed ErrorDetail."""

    code: grpc.StatusCode
    message: str
    reason: str
    """Short label for the rejected-chunks metric."""
    detail_reason: int = Reason.ERROR_REASON_INVALID_INPUT
    """common_pb2.ErrorReason for the ErrorDetail."""
    _: KW_ONLY
    retryable: bool = False
    frees: bool = True
    """Whether the reservation is freed (a protocol violation), or left as it was."""
    field: str = ""

    def __post_init__(self) -> None:
        super().__init__(self.message)


def _gone(r: Reservation | str) -> KVRejected:
    rid = r.reservation_id if isinstance(r, Reservation) else r
    why = f"ended: {r.end_cause.value}" if isinstance(r, Reservation) and r.end_cause else \
        "expired, aborted or never made"
    return KVRejected(grpc.StatusCode.NOT_FOUND, f"unknown reservation {rid!r} ({why})", "unknown_reservation",
                      Reason.ERROR_REASON_RESERVATION_GONE, retryable=True, frees=False)


async def _read(it: AsyncIterator[common_pb2.KVChunk]) -> common_pb2.KVChunk | object:
    try:
        return await anext(it)
    except StopAsyncIteration:
        return _END


@dataclass
class _Stream:
    """One PushKV stream's progress."""

    r: Reservation | None = None
    received: int = 0
    claimed: PageLayout | None = None
    """The layout an accepted claim named (None: no claim)."""
    gone: asyncio.Future | None = None
    """Resolves when the reservation ends (lease, deadline, Abort)."""
    pending: asyncio.Future | None = None
    """One chunk's checksum + page copy, running while the next chunk is read off the wire."""

    async def settle(self) -> None:
        """Wait for the chunk still landing (its failure is raised)."""
        if self.pending is not None:
            await self.pending
            self.pending = None


class DecodeKVReceiver:
    def __init__(self, engine: EngineFront, layout: PageLayout, table: ReservationTable,
                 wire_layouts: list[PageLayout] | None = None,
                 on_landed: Callable[[Reservation, common_pb2.KVChunk], None] | None = None,
                 on_rejected: Callable[[str], None] | None = None,
                 on_broken: Callable[[], None] | None = None,
                 destination: decode_pb2.KVDestination | None = None,
                 on_phase: Callable[[str, float], None] | None = None) -> None:
        self.engine = engine
        self.on_phase = on_phase
        """Observes a handoff phase (name, seconds): ``import`` = last chunk checked and its pages in -> the
        engine took the request into its batch (the engine-thread hop)."""
        self.pool_id = pool_id(destination) if destination is not None else ""
        """The pool side transports may claim (what Reserve offers); empty: none."""
        self.layout = layout
        # Layouts a chunk may arrive in: the cache's own, plus codecs decoded on arrival (fp8-e4m3).
        self.layouts = {lay.fingerprint: lay for lay in [layout, *(wire_layouts or [])]}
        self.table = table
        self.on_landed = on_landed
        self.on_rejected = on_rejected
        self.on_broken = on_broken
        self.vocab_size = engine.vocab_size
        # Where a Mooncake writer puts pages for a device pool (imported as each chunk's descriptor lands), and
        # this decode's head split (a tensor-parallel writer's claim must name it): in-process engines only (an
        # engine core offers neither: its service refuses Mooncake and tensor parallelism at start).
        pages = engine.pages if engine.in_process else None
        self.landing = landing_for(pages, self.pool_id) if pages is not None and self.pool_id else None
        self.split = spec_of(pages.shard_writes().split) if pages is not None else None

    def _reject(self, code: grpc.StatusCode, message: str, reason: str,
                detail_reason: int = Reason.ERROR_REASON_INVALID_INPUT, **kw: object) -> KVRejected:
        if self.on_rejected is not None:
            self.on_rejected(reason)
        return KVRejected(code, message, reason, detail_reason, **kw)  # type: ignore[arg-type]

    def _open(self, c: common_pb2.KVChunk) -> Reservation:
        """The reservation a stream's first chunk names, if the chunk may write into it (touches nothing)."""
        r = self.table.get(c.reservation_id)
        if r is None:
            if self.on_rejected is not None:
                self.on_rejected("unknown_reservation")
            raise _gone(c.reservation_id)
        if not r.token_ok(c.reservation_token):
            raise self._permission(c)
        if r.complete or r.receiving:
            raise self._reject(grpc.StatusCode.FAILED_PRECONDITION,
                               f"reservation {r.reservation_id} already "
                               f"{'has all its KV' if r.complete else 'has a KV stream open'}", "state",
                               Reason.ERROR_REASON_KV_HANDOFF_FAILED, retryable=not r.complete, frees=False)
        return r

    def _permission(self, c: common_pb2.KVChunk) -> KVRejected:
        return self._reject(grpc.StatusCode.PERMISSION_DENIED,
                            f"reservation_token: wrong or missing for reservation {c.reservation_id!r}",
                            "permission", Reason.ERROR_REASON_PERMISSION, frees=False, field="reservation_token")

    def _check_claim(self, r: Reservation, c: common_pb2.KVChunk) -> PageLayout:
        return check_claim(c.claim, r, self._reject, pool=self.pool_id, layout=self.layout,
                           layouts=self.layouts.values(), landing=self.landing, split=self.split)

    def _check(self, r: Reservation, c: common_pb2.KVChunk, claimed: PageLayout | None, payload: bytes | memoryview
               ) -> tuple[list[int], PageLayout]:
        """Validate one chunk (``payload``: its payload, read once) against its reservation (``claimed``: the
        layout of the stream's accepted claim, None without one); returns the destination block ids and the
        layout the chunk's pages are in."""
        self._check_stream(r, c)
        layout = self._layout_of(c, claimed)
        self._check_ranges(r, c)
        if c.is_last:
            self._check_first_token(c)
        self._check_pages(c, claimed, layout, payload)
        return r.block_ids[c.first_block:c.first_block + c.num_pages], layout

    def _check_stream(self, r: Reservation, c: common_pb2.KVChunk) -> None:
        """The chunk belongs to the stream's reservation and carries its token."""
        if c.reservation_id != r.reservation_id:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"reservation_id: one PushKV stream carries one reservation: got "
                               f"{c.reservation_id!r} after {r.reservation_id!r}", "order", field="reservation_id")
        if not r.token_ok(c.reservation_token):
            raise self._permission(c)

    def _layout_of(self, c: common_pb2.KVChunk, claimed: PageLayout | None) -> PageLayout:
        """The layout the chunk's fingerprint names (one this decode accepts, or its stream's claimed one), in the
        codec the chunk names."""
        layout = claimed if claimed is not None and claimed.fingerprint == c.layout_fingerprint else \
            self.layouts.get(c.layout_fingerprint)  # a claim naming head splits has its own layout
        if layout is None:
            accepted = " or ".join(f"{fp} ({lay.describe()})" for fp, lay in self.layouts.items())
            raise self._reject(grpc.StatusCode.FAILED_PRECONDITION,
                               f"KV layout fingerprint mismatch: chunk has {c.layout_fingerprint or '(empty)'}, "
                               f"this decode expects {accepted}", "fingerprint", Reason.ERROR_REASON_LAYOUT_MISMATCH,
                               field="layout_fingerprint")
        if c.codec and CODEC_OF.get(c.codec, self.layout.target_codec) != layout.target_codec:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"codec: {common_pb2.KVCodec.Name(c.codec)} does not match the layout's codec "
                               f"{layout.target_codec}", "fingerprint", Reason.ERROR_REASON_LAYOUT_MISMATCH,
                               field="codec")
        return layout

    def _check_ranges(self, r: Reservation, c: common_pb2.KVChunk) -> None:
        """Chunk order (no gap, no duplicate), token and page ranges inside the reservation and not over blocks
        decode already holds."""
        if c.chunk_index != r.next_chunk:
            what = "duplicate" if c.chunk_index < r.next_chunk else "out-of-order"
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"chunk_index: {what} KV chunk index {c.chunk_index}: expected {r.next_chunk}",
                               "order", field="chunk_index")
        if c.token_end > r.prompt_len or c.token_start > c.token_end:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"token_start/token_end: KV chunk token range [{c.token_start}, {c.token_end}) is "
                               f"outside the prompt of {r.prompt_len} tokens", "range", field="token_end")
        first, n = c.first_block, c.num_pages
        if first < r.num_cached_blocks or first + n > len(r.block_ids):
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"first_block/num_pages: KV chunk pages [{first}, {first + n}) fall outside the "
                               f"reserved pages [{r.num_cached_blocks}, {len(r.block_ids)})", "range",
                               field="first_block")

    def _check_first_token(self, c: common_pb2.KVChunk) -> None:
        """The last chunk's first token and its alternatives are inside the vocabulary."""
        if not 0 <= c.first_token < self.vocab_size:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"first_token: {c.first_token} is outside the vocabulary [0, {self.vocab_size})",
                               "range", field="first_token")
        top = c.first_top_logprobs
        if len(top.token_ids) != len(top.logprobs) or not all(0 <= t < self.vocab_size for t in top.token_ids):
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"first_top_logprobs: {len(top.token_ids)} token ids (each in [0, {self.vocab_size})) "
                               f"and {len(top.logprobs)} logprobs", "range", field="first_top_logprobs")

    def _check_pages(self, c: common_pb2.KVChunk, claimed: PageLayout | None, layout: PageLayout,
                     payload: bytes | memoryview) -> None:
        """Pages in the stream: exactly ``num_pages`` of the layout. Pages written in place: the stream claimed
        them, in the layout its claim named."""
        if not registry.writes_in_place(c.transport):
            want = c.num_pages * layout.page_bytes
            if len(payload) != want:
                raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"payload: KV chunk payload is {len(payload)} bytes; {c.num_pages} pages of "
                                   f"{layout.page_bytes} bytes ({layout.target_codec}) need {want}", "size",
                                   field="payload")
        elif claimed is None:
            raise self._reject(grpc.StatusCode.FAILED_PRECONDITION,
                               f"transport {c.transport!r} writes pages in place: its stream must start with a "
                               "claim", "claim", Reason.ERROR_REASON_KV_HANDOFF_FAILED, field="claim")
        elif layout is not claimed:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"transport {c.transport!r} writes pages in place: they must be in the layout its "
                               f"claim named ({claimed.describe()})", "fingerprint",
                               Reason.ERROR_REASON_LAYOUT_MISMATCH, field="layout_fingerprint")

    def _verify(self, c: common_pb2.KVChunk, payload: bytes | memoryview) -> None:
        """Worker thread: the chunk's checksum (releases the GIL)."""
        got = checksum(payload)
        if got != c.checksum:
            raise self._reject(grpc.StatusCode.DATA_LOSS,
                               f"KV chunk {c.chunk_index} checksum mismatch: header says {c.checksum:#010x}, "
                               f"payload hashes to {got:#010x}", "checksum", Reason.ERROR_REASON_DATA_LOSS,
                               retryable=True, field="checksum")

    async def _verify_and_write(self, c: common_pb2.KVChunk, payload: bytes | memoryview, block_ids: list[int],
                                layout: PageLayout) -> None:
        """Checksum, then the pages into the cache (both off the event loop)."""
        await asyncio.to_thread(self._verify, c, payload)
        landed = GRPC.accept(self.engine, block_ids, layout, payload)
        if landed is not None:
            await landed

    def _unwrap(self, m: common_pb2.KVChunk | WireChunk) -> tuple[common_pb2.KVChunk, bytes | memoryview]:
        """A message's header and payload (a view for a header-only parsed one; malformed: refused)."""
        if isinstance(m, WireChunk):
            if m.error:
                raise self._reject(grpc.StatusCode.INVALID_ARGUMENT, f"PushKV message: {m.error}", "malformed")
            return m.header, m.payload
        return m, m.payload  # read once: every read of a bytes field copies it (upb)

    async def _next(self, it: AsyncIterator[common_pb2.KVChunk | WireChunk], r: Reservation | None,
                    gone: asyncio.Future | None) -> common_pb2.KVChunk | object:
        """The next chunk, or _END; raises the gone rejection if the reservation ends while we wait."""
        if r is None or gone is None:
            return await _read(it)
        nxt = asyncio.ensure_future(_read(it))
        await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not nxt.done():
            nxt.cancel()
            await asyncio.wait({nxt})  # let the read unwind (its outcome no longer matters)
            raise _gone(r)
        return nxt.result()

    async def receive(self, chunks: AsyncIterator[common_pb2.KVChunk | WireChunk],
                      on_claimed: OnClaimed | None = None) -> decode_pb2.PushKVResponse:
        s = _Stream()
        it = aiter(chunks)
        try:
            # A claimed stream outlives its reservation: a writer may be writing into its blocks.
            while (m := await self._next(it, s.r, None if s.claimed is not None else s.gone)) is not _END:
                assert isinstance(m, common_pb2.KVChunk | WireChunk)
                await self._take(s, m, on_claimed)
            await s.settle()
            self._ended(s)
        except KVRejected as e:
            if e.frees and s.r is not None and not s.r.complete:
                await self.release(s.r, EndCause.REJECTED)
            raise
        except EngineDeadError:
            raise
        except BaseException:  # the stream broke (peer gone, cancelled): keep the reservation for a retry
            r = s.r
            if r is not None and not r.complete and r.end_cause is None and self.on_broken is not None:
                self.on_broken()
            raise
        finally:
            await self._close(s)
        return decode_pb2.PushKVResponse(chunks_received=s.received, bytes_received=s.r.bytes_received if s.r else 0)

    async def _take(self, s: _Stream, m: common_pb2.KVChunk | WireChunk, on_claimed: OnClaimed | None) -> None:
        """One message of the stream: its first opens it (and may be the claim), the others are chunks."""
        c, payload = self._unwrap(m)
        if s.r is None and await self._open_stream(s, c, on_claimed):
            return
        r = s.r
        assert r is not None
        if r.end_cause is not None:
            if s.claimed is not None:
                return  # dropped: the blocks stay held until the writer's stream ends
            raise _gone(r)
        if c.HasField("claim"):
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT, "claim: only a stream's first message "
                               "may claim the reservation", "order", field="claim")
        block_ids, layout = self._check(r, c, s.claimed, payload)
        await s.settle()
        s.pending = self._accept(s, c, payload, block_ids, layout)
        self._record(s, c, payload, layout)
        if c.is_last:
            await s.settle()
            await self._finish(r, c)

    async def _open_stream(self, s: _Stream, c: common_pb2.KVChunk, on_claimed: OnClaimed | None) -> bool:
        """The stream's first message names its reservation (and, from a writer, claims it). True when the
        message was the claim (acknowledged; no chunk in it)."""
        s.r = r = self._open(c)
        claim = self._check_claim(r, c) if c.HasField("claim") else None
        r.receiving = True
        r.reset_transfer()  # a new stream (a retried prefill) starts over
        s.gone = asyncio.ensure_future(r.gone.wait())
        if claim is None:
            return False
        s.claimed = claim
        if on_claimed is not None:
            await on_claimed()
        return True

    def _accept(self, s: _Stream, c: common_pb2.KVChunk, payload: bytes | memoryview, block_ids: list[int],
                layout: PageLayout) -> asyncio.Future | None:
        """Start landing a checked chunk's pages (in a worker or the engine thread, while the next chunk is read):
        bytes in the message are checksummed and copied in (the byte stream's connector); pages a staged writer
        put in the host landing area are imported (the staged connector's); pages written into the pool itself
        are there already."""
        if payload:
            return asyncio.ensure_future(self._verify_and_write(c, payload, block_ids, layout))
        if s.claimed is None:
            return None
        landed = MOONCAKE_STAGED.accept(self.engine, block_ids, layout, payload, self.landing)
        return None if landed is None else asyncio.ensure_future(landed)

    @staticmethod
    def _record(s: _Stream, c: common_pb2.KVChunk, payload: bytes | memoryview, layout: PageLayout) -> None:
        """The chunk's blocks are landed (or landing): the reservation's progress."""
        r = s.r
        assert r is not None
        r.pages_written.update(range(c.first_block, c.first_block + c.num_pages))
        r.next_chunk += 1
        # Page bytes landed, whichever way they came (in the message, or written by a side transport).
        r.bytes_received += len(payload) or c.num_pages * layout.page_bytes
        s.received += 1

    def _ended(self, s: _Stream) -> None:
        """The stream ended: unless its last chunk landed, it broke (the reservation is kept) or the reservation
        ended meanwhile."""
        r = s.r
        if r is None or r.complete:
            return
        if r.end_cause is not None:
            raise _gone(r)
        if self.on_broken is not None:
            self.on_broken()
        raise KVRejected(grpc.StatusCode.ABORTED,
                         f"KV stream of {r.reservation_id} ended before its last chunk ({r.next_chunk} "
                         "received); the reservation is kept: resend from chunk 0", "incomplete",
                         Reason.ERROR_REASON_KV_HANDOFF_FAILED, retryable=True, frees=False)

    async def _close(self, s: _Stream) -> None:
        """However the stream ended: the last copy lands before the blocks can be reused; a reservation released
        while the stream wrote has its blocks freed now; an unfinished one forgets the stream's progress."""
        if s.gone is not None:
            s.gone.cancel()
        if s.pending is not None:
            await asyncio.gather(s.pending, return_exceptions=True)
        r = s.r
        if r is None:
            return
        r.receiving = False
        if r.end_cause is not None:
            await self._free(r)
        elif not r.complete:
            r.reset_transfer()

    async def _finish(self, r: Reservation, c: common_pb2.KVChunk) -> None:
        if c.total_chunks and c.total_chunks != c.chunk_index + 1:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"total_chunks: last KV chunk says total_chunks={c.total_chunks} but is chunk "
                               f"{c.chunk_index}", "order", field="total_chunks")
        missing = sorted(set(range(r.num_cached_blocks, len(r.block_ids))) - r.pages_written)
        if missing:
            raise self._reject(grpc.StatusCode.INVALID_ARGUMENT,
                               f"last KV chunk arrived but pages {missing[:8]}{'...' if len(missing) > 8 else ''} "
                               "of the prompt never did", "incomplete")
        if r.end_cause is not None:
            raise _gone(r)
        if r.lease is not None:  # every page is in: the lease has done its job
            r.lease.cancel()
            r.lease = None
        t0 = time.monotonic()
        if not await self.engine.kv_import_done(r.reservation_id, c.first_token,
                                                c.first_logprob if r.params.logprobs else None,
                                                top_from_pb(c.first_top_logprobs) if r.params.top_logprobs else None):
            await self.release(r, EndCause.ABORTED)  # the engine no longer waits for it
            raise _gone(r)
        r.kv_done_at = time.monotonic()
        if self.on_phase is not None:
            self.on_phase("import", r.kv_done_at - t0)
        if self.on_landed is not None:
            self.on_landed(r, c)

    @staticmethod
    def poll(r: Reservation) -> KVPoll:
        """Where a reservation's KV stands: BOOTSTRAPPING (reserved, no stream), WAITING_FOR_INPUT (a stream
        is open, a writer's claim accepted, no chunk yet), TRANSFERRING, SUCCESS (every page landed) or
        FAILED (ended early: expired, deadline, rejected, aborted)."""
        if r.end_cause is not None:
            return KVPoll.FAILED
        if r.complete:
            return KVPoll.SUCCESS
        if r.receiving:
            return KVPoll.TRANSFERRING if r.next_chunk else KVPoll.WAITING_FOR_INPUT
        return KVPoll.BOOTSTRAPPING

    async def release(self, r: Reservation, cause: EndCause) -> None:
        """End a reservation that will not run to completion (rejected, expired, deadline, aborted): it
        leaves the table at once; its blocks are freed now, or by its KV stream once the page write in
        flight is done. Idempotent."""
        if r.end_cause is not None:
            return
        r.end_cause = cause
        self.table.remove(r)
        r.gone.set()
        if not r.receiving:
            await self._free(r)

    async def _free(self, r: Reservation) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead engine frees nothing (the process is going)
            await asyncio.shield(self.engine.abort(r.reservation_id))
