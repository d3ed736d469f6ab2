"""Prefill servicer: computes a prompt's KV in chunks and streams the pages to a reserved decode.

Admission is bounded (``--max-queued`` requests admitted and not finished; past it RESOURCE_EXHAUSTED
with reason OVERLOADED and a retry-after hint). A request's deadline (``deadline_unix`` or the gRPC
deadline, the earlier) bounds everything it does here: past it the request is aborted in the engine,
its blocks freed, and the RPC ends DEADLINE_EXCEEDED. A cancelled RPC frees everything the same way.
Every failure carries a typed ErrorDetail (side "prefill", or side "decode" with reason
KV_HANDOFF_FAILED when the handoff to decode failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid

import grpc

from services.common import tracing
from services.common.grpc_util import Reason, abort, abort_if_draining, error_detail, payload_budget
from services.common.kv_kinds import MOONCAKE
from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2, prefill_pb2_grpc
from services.common.tls import peer_role
from services.engine.async_engine import EngineDeadError, EngineFront
from services.engine.device_defaults import batch_defaults
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_transport import KVSender, KVTransport, TransferError
from services.engine.kv_transport.base import PageWriter
from services.engine.scheduler import ScheduledChunk
from services.kv.claim import claim_message
from services.kv.planner import DirectWrites, InvalidDestinationError
from services.prefill.attach import Attachments, Waiting
from services.prefill.attach_rpc import EarlyAttach
from services.prefill.config import PrefillConfig
from services.prefill.engine_port import PrefillEngine, prefill_engine
from services.prefill.kv_stream import (
    AttachTimeout,
    PagesReady,
    RequestKVStream,
    header_room,
    message_export,
    pump,
)
from services.prefill.kvstore_prefix import KVStorePrefix
from services.prefill.outcome import Handoff, handoff_detail, refusal, stream_times
from services.prefill.request_checks import deadline_monotonic, layout_mismatch, problem
from services.text.sampling_params import InvalidRequestError, Sampled
from services.text.sampling_pb import params_from_pb, top_to_pb

log = logging.getLogger(__name__)

SIDE = "prefill"
RETRY_AFTER_MS = (100, 30_000)
"""Bounds of the retry-after hint sent with OVERLOADED (milliseconds)."""
_EWMA = 0.2
"""Weight of the newest request in the moving average of request durations."""


class PrefillServicer(EarlyAttach, prefill_pb2_grpc.PrefillServicer):
    def __init__(self, config: PrefillConfig, metrics: PrefillMetrics, transport: KVTransport,
                 draining: asyncio.Event) -> None:
        self.config = config
        self.metrics = metrics
        self.transport = transport
        self.draining = draining
        self.engine: EngineFront = None  # type: ignore[assignment]  # bound once the model is loaded
        self.port: PrefillEngine = None  # type: ignore[assignment]  # the page-level reach into it (engine_port.py)
        self.streams: dict[str, RequestKVStream] = {}
        self.inflight = 0
        """Requests admitted and not finished (bounded by max_queued)."""
        self.kvstore: KVStorePrefix | None = None
        self.attachments = Attachments()
        """Early Prefill calls waiting for their reservation (AttachReservation)."""
        self.direct = DirectWrites(config.kv_transport, metrics, config.kv_mooncake_host,
                                   config.kv_mooncake_staging_bytes, config.kv_mooncake_engines)
        self._request_s = 1.0  # moving average of admitted requests' durations (seconds)
        self.max_queued = config.max_queued or batch_defaults("cpu").prefill_queue
        """--max-queued, or the engine's device's default once bound (the CPU's until then)."""

    @property
    def saturated(self) -> bool:
        """True when a new request would be refused now (load reports read it)."""
        return self.inflight >= self.max_queued

    def bind(self, engine: EngineFront) -> None:
        """``engine``: an in-process AsyncEngine or an engine core's client (engine_port.py)."""
        self.engine = engine
        self.port = prefill_engine(engine)
        self.pages = self.port.pages
        self.max_queued = self.config.max_queued or batch_defaults(engine.device).prefill_queue
        shards = self.direct.shards = self.pages.shard_writes()  # rank to rank (parallel/rank_pages)
        shards.on_pages = lambda rank, n: self.metrics.kv_rank_pages_total.labels(str(rank)).inc(n)
        self.direct.regions = self.pages.region_pools  # side transports write them too (region_pools.py)
        if self.port.llm is None:
            self.direct.unavailable = {MOONCAKE.transport: "its transfer engine registers the pool in the process that "
                                                   "steps (this prefill's loop runs in an engine core; "
                                                   "--engine-core thread writes through it)"}
        self.model = engine.model_id
        self.layout = engine.layout
        self.port.listen(self._on_chunk)
        engine.add_death_callback(self._on_engine_death)
        if self.config.kvstore_address:
            cfg = self.config
            self.kvstore = KVStorePrefix(
                cfg.kvstore_address, self.layout, self.pages.page_shape,
                self.pages.dtype, tls=cfg if cfg.tls_enabled else None, timeout_s=cfg.kvstore_timeout_s,
                retry_s=cfg.kvstore_retry_s, max_pending_writes=cfg.kvstore_max_pending_writes,
                on_error=lambda reason: self.metrics.kvstore_errors_total.labels(reason).inc())
            if cfg.kvstore_write_back:  # the write-back's ring and writer process (kvstore_writeback.py)
                self.kvstore.start_writer(lambda block_ids, out: self.pages.export(block_ids, None, out),
                                          self.pages.device, cfg.write_back_bytes(self.pages.device.type))

    async def close(self) -> None:
        if self.kvstore is not None:
            await self.kvstore.close()

    def _on_engine_death(self, err: BaseException) -> None:
        """Any thread: the step loop (or its core) died; every open request ends now with EngineDeadError
        (UNAVAILABLE / ENGINE_DEAD, retryable) instead of waiting for a chunk that never comes."""
        dead = err if isinstance(err, EngineDeadError) else EngineDeadError(f"engine loop died: {err!r}")
        for stream in list(self.streams.values()):
            stream.fail(dead)

    # --- engine thread (or, with an engine core, the event loop) ---

    def _on_chunk(self, ch: ScheduledChunk, sampled: Sampled | None, step_start: float) -> None:
        """Route a computed chunk to its request's stream (engine_port.py says where this runs)."""
        stream = self.streams.get(ch.seq.request_id)
        if stream is None:
            if ch.sample:
                self.port.dropped(ch.seq.request_id)
            return
        stream.on_chunk(ch, sampled, step_start)
        if self.config.slowdown_ms_per_chunk:
            self.port.stall(self.config.slowdown_ms_per_chunk / 1000.0)

    # --- the RPC ---

    async def _refuse(self, context: grpc.aio.ServicerContext, reason: str, code: grpc.StatusCode, message: str,
                      detail_reason: int, *, retryable: bool = False, field: str = "", retry_after_ms: int = 0
                      ) -> None:
        self.metrics.requests_aborted_total.labels(reason).inc()
        await abort(context, code, message, error_detail(detail_reason, retryable=retryable, side=SIDE, field=field,
                                                         retry_after_ms=retry_after_ms))

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
                      ) -> prefill_pb2.PrefillResponse:
        await abort_if_draining(context, self.draining, SIDE)
        if self.engine is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "prefill is still loading its model",
                        error_detail(Reason.ERROR_REASON_LOADING, retryable=True, side=SIDE))
        if self.config.tls_enabled and peer_role(context) != "router":
            await self._refuse(context, "permission", grpc.StatusCode.PERMISSION_DENIED,
                               "Prefill: only the router (client certificate role 'router') may call it",
                               Reason.ERROR_REASON_PERMISSION)
        eng = self.engine
        bad = problem(request, vocab_size=eng.vocab_size, max_model_len=eng.max_model_len,
                      block_size=self.layout.block_size)
        if bad is not None:
            await self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, f"{bad[0]}: {bad[1]}",
                               Reason.ERROR_REASON_INVALID_INPUT, field=bad[0])
        mismatch = layout_mismatch(request, self.layout)
        if mismatch is not None:
            await self._refuse(context, "invalid", grpc.StatusCode.FAILED_PRECONDITION, mismatch,
                               Reason.ERROR_REASON_LAYOUT_MISMATCH, field="expected_layout_fingerprint")
        try:
            params = params_from_pb(request.params)
        except InvalidRequestError as e:
            await self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(e),
                               Reason.ERROR_REASON_INVALID_INPUT, field=f"params.{e.field}")
        deadline = deadline_monotonic(request.deadline_unix, context.time_remaining())
        if deadline is not None and deadline <= time.monotonic():
            await self._refuse(context, "deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                               "the request's deadline passed before prefill began", Reason.ERROR_REASON_DEADLINE)
        if self.saturated:
            retry_ms = min(max(int(self._request_s * 1000), RETRY_AFTER_MS[0]), RETRY_AFTER_MS[1])
            await self._refuse(context, "overloaded", grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"prefill queue full: {self.inflight} requests admitted (--max-queued "
                               f"{self.max_queued}); retry another instance or in {retry_ms} ms",
                               Reason.ERROR_REASON_OVERLOADED, retryable=True, retry_after_ms=retry_ms)
        # Prefill samples the first token only; stopping is decode's job.
        first_params = dataclasses.replace(params, max_tokens=1, stop=[], stop_token_ids=[], ignore_eos=True)
        self.inflight += 1
        start = time.monotonic()
        if request.sent_unix:
            self._phase("rpc_in", max(0.0, time.time() - request.sent_unix))
        try:
            loop = asyncio.get_running_loop()
            try:
                when = None if deadline is None else loop.time() + (deadline - time.monotonic())
                async with asyncio.timeout_at(when):
                    resp = await self._serve(request, context, first_params, start)
            except TimeoutError:
                await self._refuse(context, "deadline", grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"the request's deadline passed after {time.monotonic() - start:.2f} s in prefill; "
                                   "it was dropped and its blocks freed", Reason.ERROR_REASON_DEADLINE)
            self._request_s += _EWMA * (time.monotonic() - start - self._request_s)
            return resp
        except asyncio.CancelledError:
            # grpc.aio cancels the handler when the call's own deadline fires (time_remaining() is then 0):
            # that is a deadline, not the client leaving
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            self.metrics.requests_aborted_total.labels("deadline" if expired else "cancelled").inc()
            raise
        finally:
            self.inflight -= 1

    async def _serve(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext,
                     first_params, arrival: float) -> prefill_pb2.PrefillResponse:
        """``arrival``: when the Prefill call began (monotonic; writer setup counts in its phases)."""
        ids = list(request.token_ids)
        h = await self._handoff(request, context, ids, arrival)
        with tracing.span_from_metadata("prefill.request", context.invocation_metadata(),
                                        request_id=request.request_id, prompt_tokens=len(ids)) as sp:
            try:
                last, page_bytes, loaded = await self._run(h, context, ids, first_params)
            except AttachTimeout as e:  # no reservation came: decode was never contacted, nothing was written
                await self._cleanup(h.rid, h.sender, str(e), h.writer, h.stream)
                self.metrics.requests_aborted_total.labels("attach_timeout").inc()
                await abort(context, e.code, f"KV handoff to decode (none attached) failed: {e}", handoff_detail(e))
            except TransferError as err:
                await self._handoff_failed(h, context, refusal(h.claim) or err)  # decode's answer to the claim first
            except grpc.aio.AbortError:
                raise
            except EngineDeadError as e:  # the step loop (or its core) died: this instance is going down
                await self._cleanup(h.rid, h.sender, "engine dead", h.writer, h.stream)
                self.metrics.requests_aborted_total.labels("engine_dead").inc()
                await abort(context, grpc.StatusCode.UNAVAILABLE, f"prefill's engine loop died ({e}); this instance "
                            "is going down", error_detail(Reason.ERROR_REASON_ENGINE_DEAD, retryable=True, side=SIDE))
            except Exception as e:  # a page read or direct write failed on the engine thread
                log.exception("prefill of %s failed", request.request_id)
                await self._cleanup(h.rid, h.sender, repr(e), h.writer, h.stream)
                self.metrics.requests_aborted_total.labels("internal").inc()
                await abort(context, grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}",
                            error_detail(Reason.ERROR_REASON_UNSPECIFIED, side=SIDE))
            except BaseException:  # cancelled: the client left or the deadline passed
                await self._cleanup(h.rid, h.sender, "cancelled", h.writer, h.stream)
                raise
            finally:
                await self._ended(h)
            sp.set_attribute("chunks", h.stream.num_chunks_computed)
        assert h.sender is not None
        self._observe(h.request, h.stream, loaded, h.transport, page_bytes, h.sender.chunks_sent)
        return self._response(h, last, len(ids), page_bytes)

    async def _handoff(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, ids: list[int],
                       arrival: float) -> Handoff:
        """The request's writer (or, early, its wait for the reservation that brings it), wire codec and stream."""
        waiting: Waiting | None = None
        writer: PageWriter | None = None
        if request.attach_id:  # early: the reservation (and so the writer) comes with AttachReservation
            waiting = self.attachments.register(request)
            if waiting is None:
                await self._refuse(context, "invalid", grpc.StatusCode.FAILED_PRECONDITION,
                                   "attach_id: another Prefill call on this prefill uses it",
                                   Reason.ERROR_REASON_INVALID_INPUT, field="attach_id")
        else:
            try:
                writer = await self.direct.writer(request, self.pages.pool, -(-len(ids) // self.layout.block_size),
                                                  self.pages.export, self._fp8_agreed(request))
            except InvalidDestinationError as e:
                await self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, f"dest_block_ids: {e}",
                                   Reason.ERROR_REASON_INVALID_INPUT, field="dest_block_ids")
        wire, export = self._wire_codec(request, writer)
        chunked = request.chunked_transfer if request.HasField("chunked_transfer") else self.config.chunked_transfer
        rid = f"{request.request_id}/{uuid.uuid4().hex[:8]}"
        stream = RequestKVStream(asyncio.get_running_loop(), export, self.layout.block_size, request.num_skip_blocks,
                                 chunked, arrival, writer, engine=self.port, claim_wait_s=self.config.claim_wait_s,
                                 pending=waiting is not None,
                                 writeback_begin=None if self.kvstore is None else self.kvstore.write_back_begin)
        transport = writer.transport if writer is not None else self.transport.name
        return Handoff(request, rid, stream, writer, wire, transport, waiting)

    async def _run(self, h: Handoff, context: grpc.aio.ServicerContext, ids: list[int], first_params
                   ) -> tuple[PagesReady, int, int]:
        """Open the stream (or wait for an early request's reservation), admit, pump the pages, finish the stream.
        Returns the last item, the page bytes sent and the blocks loaded from the kvstore."""
        if h.waiting is None:
            h.sender = self.transport.open(h.request.decode_address, h.rid, metadata=tuple(tracing.inject_metadata()))
            h.claim = await self._claim(h.request, h.stream, h.sender, h.writer)
        self.streams[h.rid] = h.stream
        if h.waiting is not None and self._attach_before_compute(ids):
            await self._attached(h, *await self._await_attach_first(h.waiting, h.stream))
        elif h.waiting is not None:  # answered while admission runs (kvstore fetch, engine-thread calls)
            h.attach = asyncio.ensure_future(self._await_attach(h.waiting, h.stream))
        try:
            loaded = await self._admit(h.rid, ids, first_params, h.stream, h.attach)
            self._phase("admitted", time.monotonic() - h.stream.arrival)
        except ValueError as e:  # InvalidRequestError, or a prompt this pool can never hold
            await self._cleanup(h.rid, h.sender, "refused", h.writer, h.stream)
            await self._refuse(context, "invalid", grpc.StatusCode.INVALID_ARGUMENT, str(e),
                               Reason.ERROR_REASON_INVALID_INPUT, field=getattr(e, "field", "") or "token_ids")
        if h.attach is not None:  # computing already; nothing is written before the ack
            await self._attached(h, *await h.attach)
        assert h.sender is not None
        r = h.request
        last, page_bytes = await pump(h.stream, h.sender, r.request_id, r.reservation_id, r.reservation_token, h.wire,
                                      payload_budget(self.config.max_message_bytes), h.transport)
        await self._finish(h)
        if self.kvstore is not None:  # handed off: the new full pages go to the kvstore (writer process)
            writeback, h.stream.writeback = h.stream.writeback, None
            if writeback is not None:
                self.kvstore.write_back(h.stream.hashes, *writeback)
            elif h.stream.writeback_skipped:
                self.kvstore.write_back_skipped(h.stream.writeback_skipped)
        return last, page_bytes, loaded

    async def _finish(self, h: Handoff) -> None:
        """Every page sent: the claim's answer (if still due), then decode's answer on the closed stream."""
        stream = h.stream
        if h.claim is not None:  # answered by now unless no page was due: then the stream ends after it
            await h.claim
        self._phase("claim", (stream.claim_answered or time.monotonic()) - stream.arrival)
        if stream.last_picked is not None and stream.last_computed is not None:
            self._phase("picked", stream.last_picked - stream.last_computed)
        self._since_computed("last_sent", stream)
        assert h.sender is not None
        with tracing.span("prefill.kv_finish"):
            await h.sender.finish()
        self._since_computed("finish", stream)

    async def _handoff_failed(self, h: Handoff, context: grpc.aio.ServicerContext, e: TransferError) -> None:
        self.metrics.kv_transfer_failures_total.labels(h.transport, e.code.name.lower()).inc()
        await self._cleanup(h.rid, h.sender, str(e), h.writer, h.stream)
        self.metrics.requests_aborted_total.labels("kv_handoff").inc()
        await abort(context, e.code, f"KV handoff to decode {h.request.decode_address or '(none attached)'} "
                                     f"failed: {e}", handoff_detail(e))

    async def _ended(self, h: Handoff) -> None:
        """However the call ended: the stream leaves the engine-thread routing; an attach it had taken is answered;
        the claim's outcome was read or no longer matters; a kvstore write-back span not handed to the writer
        goes back."""
        self.streams.pop(h.rid, None)
        if h.stream.writeback is not None and self.kvstore is not None:  # failed: its ring span goes back unwritten
            self.kvstore.write_back_abandon(h.stream.writeback[1])
            h.stream.writeback = None
        if h.waiting is not None:
            self.attachments.remove(h.waiting)
        for task in (h.attach, h.claim):
            if task is not None:  # ended (or cancelled here)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _response(self, h: Handoff, last: PagesReady, num_prompt_tokens: int, page_bytes: int
                  ) -> prefill_pb2.PrefillResponse:
        assert h.sender is not None
        queue_s, compute_s = stream_times(h.stream)
        resp = prefill_pb2.PrefillResponse(
            first_token=last.first_token, first_logprob=last.first_logprob,
            num_prompt_tokens=num_prompt_tokens, num_cached_tokens=h.stream.num_cached_tokens,
            num_chunks=h.sender.chunks_sent, kv_bytes_sent=page_bytes, queue_s=queue_s, compute_s=compute_s)
        if last.first_top is not None:
            resp.first_top_logprobs.CopyFrom(top_to_pb(last.first_top))
        self._phase("respond", time.monotonic() - h.stream.arrival)
        return resp

    async def _attached(self, h: Handoff, request: prefill_pb2.PrefillRequest, writer: PageWriter | None) -> None:
        """An early request's reservation taken: its wire codec, export, transport name, sender and claim."""
        h.request, h.writer = request, writer
        wire, export = self._wire_codec(request, writer)
        transport = writer.transport if writer is not None else self.transport.name
        sender = self.transport.open(request.decode_address, h.rid, metadata=tuple(tracing.inject_metadata()))
        h.stream.attach(writer, export, request.num_skip_blocks)  # no engine hop: the step may be long
        claim = await self._claim(request, h.stream, sender, writer)
        h.wire, h.transport, h.sender, h.claim = wire, transport, sender, claim

    async def _claim(self, request: prefill_pb2.PrefillRequest, stream: RequestKVStream, sender: KVSender,
                     writer: PageWriter | None) -> asyncio.Future[None] | None:
        """Open the KV stream to decode. A writer's claim, and an early request's byte stream, run while the
        prompt computes (the stream writes nothing before decode's answer); a full request's byte stream is
        opened before admission."""
        if writer is not None:  # decode must hold the reservation before any write: the stream waits
            writer.sender = sender
            return stream.claim(sender, claim_message(request.request_id, request.reservation_id,
                                                      request.reservation_token, writer, list(request.dest_block_ids)))
        if request.attach_id:
            return stream.claim(sender, None)
        await sender.bootstrap()
        stream.claim_answered = time.monotonic()
        return None

    def _fp8_agreed(self, request: prefill_pb2.PrefillRequest) -> PageLayout | None:
        """The fp8-e4m3 layout when this prefill is configured for it and decode accepted it at Reserve."""
        fp8 = self.engine.fp8_layout
        agreed = self.config.kv_wire_codec == FP8_CODEC and fp8.fingerprint in request.accepted_wire_fingerprints
        return fp8 if agreed else None

    def _wire_codec(self, request: prefill_pb2.PrefillRequest, writer: PageWriter | None):
        """(layout of the pages on the wire, page exporter). The codec is chosen on its own: fp8-e4m3 when
        configured and decode accepted that layout's fingerprint at Reserve, and the side transport (if any)
        carries it (``writer.carry``: mooncake into a host landing area); the cache's own layout otherwise."""
        fp8 = self._fp8_agreed(request)
        if writer is not None and writer.splits is not None:  # head shards: the layout names both splits
            return self.layout.with_splits(*writer.splits), self.pages.export
        if writer is None and self.pages.exports_messages:  # CPU byte stream: pages gathered into the messages
            layout = fp8 or self.layout
            room = header_room(request.request_id, request.reservation_id, request.reservation_token, layout,
                               self.transport.name, request.params.top_logprobs)
            return layout, message_export(self.pages, layout, FP8_CODEC if fp8 is not None else None,
                                          payload_budget(self.config.max_message_bytes), room)
        if fp8 is not None and (writer is None or writer.carry(fp8)):
            return fp8, lambda block_ids: self.pages.export(block_ids, FP8_CODEC)
        return self.layout, self.pages.export

    async def _admit(self, rid: str, ids: list[int], params, stream: RequestKVStream,
                     attach: asyncio.Future[tuple[prefill_pb2.PrefillRequest, PageWriter | None]] | None = None
                     ) -> int:
        """Load what the kvstore has beyond the local prefix, then admit the request (one engine-thread
        step, so the loaded pages cannot be evicted in between). Returns the blocks loaded. ``attach``: an
        early request's wait for its reservation (its writer decides tail splitting once it is known)."""
        pages = None
        first = 0
        if self.kvstore is not None:
            hashes = self.kvstore.hashes(ids)
            first = await self.port.prefix_blocks(ids)
            present, pages = await self.kvstore.fetch(hashes, len(ids), first)
            if self.kvstore.writes_back:
                stream.writeback_from = max(present, 0)
                stream.hashes = hashes

        writer = stream.writer
        if attach is not None and attach.done() and not attach.cancelled() and attach.exception() is None:
            writer = attach.result()[1]  # attached already: None is bytes in the stream, no overlap
            overlaps = writer is not None and writer.overlaps_compute
        elif writer is not None:
            overlaps = writer.overlaps_compute
        else:  # an early request's writer is not known yet: its transport's (mooncake writers overlap compute)
            overlaps = stream.pending and self.direct.modes.overlaps_compute
        tail = stream.chunked and overlaps
        return await self.port.admit(rid, ids, params, tail, first, pages)

    async def _cleanup(self, rid: str, sender: KVSender | None, reason: str, writer: PageWriter | None = None,
                       stream: RequestKVStream | None = None) -> None:
        """Abort the request in the engine (frees its blocks; a no-op when it never got there: an admit
        still queued runs first, so it cannot slip past) and the KV stream to decode. A side transport's
        writes in flight land first: decode frees the blocks they target once the stream ends. Runs to
        its end in that order even when the request's task is cancelled again meanwhile: the call returns
        (and the request stops counting in flight, which drain() waits on) only once it is done."""
        task = asyncio.ensure_future(self._cleanup_now(rid, sender, reason, writer, stream))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            while not task.done():  # cancelled again: the cleanup still ends before this call does
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)
            raise

    async def _cleanup_now(self, rid: str, sender: KVSender | None, reason: str, writer: PageWriter | None,
                           stream: RequestKVStream | None) -> None:
        if stream is not None:  # no chunk computed from now on is written unless the claim was acknowledged
            stream.stop_waiting()
        try:
            if writer is not None:  # a write the engine thread was already asked for (a deferred one) has started
                await self.port.run(_started)
                await asyncio.to_thread(writer.quiesce)  # ... and landed before its source blocks are freed
            await self.engine.abort(rid)  # frees blocks held for a deferred write too
        except EngineDeadError:  # nothing left to free
            log.warning("engine is dead; %s was not aborted in it", rid)
        if writer is not None:  # writes of chunks computed meanwhile (claim acknowledged) land before the stream ends
            await asyncio.to_thread(writer.quiesce)
        if sender is not None:
            await sender.abort(reason)

    def _phase(self, phase: str, seconds: float) -> None:
        self.metrics.handoff_phase_seconds.labels(phase).observe(seconds)

    def _since_computed(self, phase: str, stream: RequestKVStream) -> None:
        """Observe ``phase`` as the time since the request's last chunk was computed."""
        if stream.last_computed is not None:
            self._phase(phase, time.monotonic() - stream.last_computed)

    def _observe(self, request: prefill_pb2.PrefillRequest, stream: RequestKVStream, loaded: int, transport: str,
                 page_bytes: int, chunks_sent: int) -> None:
        m = self.metrics
        queue_s, compute_s = stream_times(stream)
        m.queue_seconds.labels(self.model).observe(queue_s)
        m.compute_seconds.labels(self.model).observe(compute_s)
        m.chunks_total.labels(self.model).inc(stream.num_chunks_computed)
        m.computed_tokens_total.labels(self.model).inc(stream.num_computed_tokens)
        bs = self.layout.block_size
        from_store = min(stream.num_cached_tokens, loaded * bs)
        if from_store:
            m.cached_prefix_tokens_total.labels(self.model, "kvstore").inc(from_store)
        if stream.num_cached_tokens > from_store:
            m.cached_prefix_tokens_total.labels(self.model, "local").inc(stream.num_cached_tokens - from_store)
        if request.num_skip_blocks:  # not sent, not "not computed": computed + cached stays the prompt
            m.kv_skipped_tokens_total.labels(self.model).inc(min(len(request.token_ids),
                                                                 request.num_skip_blocks * bs))
        m.kv_sent_bytes_total.labels(transport).inc(page_bytes)
        m.kv_chunks_sent_total.labels(transport).inc(chunks_sent)

    async def drain(self) -> None:
        while self.inflight:  # noqa: ASYNC110 (bounded by the server's drain timeout)
            await asyncio.sleep(0.05)


def _started() -> None:
    """Engine thread: nothing; returns once every command queued before it has run."""
