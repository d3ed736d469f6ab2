"""Decode servicer: Reserve, RenewLease, PushKV, Generate, Abort (thin; domain logic in reservations,
leases and kv_receiver).

Admission (Reserve, colocated Generate) reads the engine's published stats, never waits behind a
step to refuse: draining -> UNAVAILABLE/DRAINING, engine dead -> UNAVAILABLE/ENGINE_DEAD, more than
``max_pending`` requests admitted and not running, or no free KV block -> RESOURCE_EXHAUSTED/OVERLOADED
(retryable, with retry_after_ms). Block allocation itself runs on the engine thread. Existing
reservations (PushKV, Generate, RenewLease) are served while draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc

from services.common import tracing
from services.common.grpc_util import Reason, abort_if_draining
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.tls import peer_identity, peer_may_write_kv, peer_role
from services.decode import errors
from services.decode.config import DecodeConfig
from services.decode.kv_receiver import DecodeKVReceiver, KVRejected
from services.decode.leases import LeaseKeeper
from services.decode.progress import TokenProgress, fill_response
from services.decode.reservations import EndCause, Reservation, ReservationTable, caller_share
from services.decode.step_stream import StepStream
from services.engine.async_engine import EngineDeadError, EngineFront, StepSubscriber
from services.engine.block_manager import NoFreeBlocksError
from services.engine.convert import layout_to_pb
from services.engine.device_defaults import batch_defaults
from services.engine.engine import RequestOutput
from services.engine.kv_transport.base import CLAIM_ACK, KVPoll
from services.engine.kv_transport.grpc_wire import WireChunk
from services.engine.sequence import FinishReason
from services.kv import registry
from services.kv.offer import offered_pool
from services.text.sampling_params import InvalidRequestError, SamplingParams
from services.text.sampling_pb import params_from_pb

log = logging.getLogger(__name__)
T = TypeVar("T")
BLOCK_POLL_S = 0.01
"""How often the Reserve at the head of the wait for free KV blocks reads the engine's published stats (seconds)."""


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, config: DecodeConfig, metrics: DecodeMetrics, draining: asyncio.Event) -> None:
        self.config = config
        self.metrics = metrics
        self.draining = draining
        self.table = ReservationTable()
        self._bg: set[asyncio.Future] = set()
        self._admitting = 0
        """Admission calls waiting on the engine thread (count; part of the pending bound)."""
        self._block_queue: deque[asyncio.Future[None]] = deque()
        """Reserves waiting for free KV blocks, in arrival order, each by the future that says it is its turn:
        only the head polls the engine's published free blocks; the others sleep until their turn or their
        give-up time."""
        self._queue_moved_at = -math.inf
        """When a waiting Reserve last got its blocks (monotonic): the queue is moving while this is recent."""
        self.generating = 0
        """Open Generate streams (count; drain waits for them)."""
        self._colocated_ids: dict[str, str] = {}
        """Colocated requests: the caller's request id -> engine request id (decode picks the latter)."""
        self.engine: EngineFront = None  # type: ignore[assignment]  # bound once the model is loaded
        self.max_pending = config.max_pending or batch_defaults("cpu").decode_pending
        """--max-pending, or the engine's device's default once bound (the CPU's until then)."""

    def bind(self, engine: EngineFront) -> None:
        """Attach the loaded engine (the server answers NOT_SERVING until then)."""
        metrics = self.metrics
        self.engine = engine
        self.max_pending = self.config.max_pending or batch_defaults(engine.device).decode_pending
        self.model = engine.model_id
        self.layout = engine.layout
        self._layout_pb = layout_to_pb(self.layout)
        """Reserve's answer names the layout and the wire fingerprints; both are frozen, so they are
        built once here (each fingerprint is a JSON dump + sha256, ~0.05 ms, per Reserve before)."""
        self._wire_fingerprints = [engine.fp8_layout.fingerprint]
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        self.destination = (offered_pool(engine.pages, self.config.kv_mooncake_host, self.config.kv_mooncake_engines)
                            if engine.in_process else engine.offered_pool)
        """The pool this decode offers side transports (None: page bytes in the stream only)."""
        self.receiver = DecodeKVReceiver(engine, self.layout, self.table, [engine.fp8_layout],
                                         destination=self.destination, on_landed=self._landed,
                                         on_rejected=lambda reason: metrics.kv_chunks_rejected_total.labels(reason).inc(),
                                         on_broken=lambda: metrics.kv_streams_broken_total.labels(self.model).inc(),
                                         on_phase=lambda phase, s: metrics.handoff_phase_seconds.labels(phase).observe(s))
        self.leases = LeaseKeeper(self.config, self.receiver.release, on_end=self._lease_ended)
        self._block_queue_changed()  # the series exists (0) from the start

    # --- admission ---

    @property
    def _block_waiters(self) -> int:
        """Reserves waiting for free KV blocks (counted as pending)."""
        return len(self._block_queue)

    def _pending(self, stats: dict[str, float]) -> int:
        return self.table.num_awaiting_kv() + int(stats.get("waiting", 0)) + self._admitting + self._block_waiters

    def admission(self, stats: dict[str, float]) -> tuple[int, bool]:
        """(max_waiting, queue full) for the load report, from the engine's published ``stats``."""
        return self.max_pending, self._pending(stats) >= self.max_pending

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: int,
                      label: str, **kw: object) -> None:
        self.metrics.requests_refused_total.labels(label).inc()
        await errors.fail(context, code, message, reason, **kw)  # type: ignore[arg-type]

    async def _router_only(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        """With mTLS on, Reserve/Generate/RenewLease/Abort answer only the router's certificate."""
        if self.config.tls_enabled and peer_role(context) != "router":
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                               f"{rpc}: only the router (client certificate role 'router') may call it",
                               Reason.ERROR_REASON_PERMISSION, "permission")

    async def _admit(self, context: grpc.aio.ServicerContext, *, needs_blocks: bool) -> None:
        """Refuse new work from published state only (never waits on the engine)."""
        if self.draining.is_set():
            self.metrics.requests_refused_total.labels("draining").inc()
            await abort_if_draining(context, self.draining, "decode")
        if self.engine is None:
            await errors.loading(context)
        if self.engine.dead is not None:
            await errors.engine_dead(context, self.engine.dead)
        s = self.engine.published_stats()
        pending = self._pending(s)
        if pending >= self.max_pending or (needs_blocks and s.get("free_blocks", 1) <= 0):
            why = (f"{pending} requests pending (max {self.max_pending})" if pending >= self.max_pending
                   else "no free KV blocks")
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"decode is overloaded: {why}",
                               Reason.ERROR_REASON_OVERLOADED, "overloaded", retryable=True,
                               retry_after_ms=self.config.overload_retry_after_ms)

    async def _check_prompt(self, context: grpc.aio.ServicerContext, ids: list[int]) -> None:
        if not ids:
            await errors.invalid(context, "token_ids", "token_ids (prompt): must not be empty")
        if len(ids) >= self.max_model_len:
            await errors.invalid(context, "token_ids", f"token_ids (prompt): {len(ids)} tokens do not fit the "
                                                       f"context of {self.max_model_len} tokens (one position must "
                                                       "remain for the output)")
        if min(ids) >= 0 and max(ids) < self.vocab_size:  # C scans; the Python one runs only on a bad id
            return
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            await errors.invalid(context, "token_ids", f"token_ids: token id {ids[bad]} at position {bad} is outside "
                                                       f"the vocabulary [0, {self.vocab_size})")

    async def _params(self, context: grpc.aio.ServicerContext, p: common_pb2.SamplingParams) -> SamplingParams:
        try:
            return params_from_pb(p)
        except InvalidRequestError as e:
            await errors.invalid(context, f"params.{e.field}", str(e))

    async def _engine_admit(self, context: grpc.aio.ServicerContext, admit: Awaitable[T],
                            undo: Callable[[], Awaitable[object]], *, no_blocks_raises: bool = False) -> T:
        """Await an admission on the engine thread; if the call is cancelled meanwhile, ``undo()`` runs once
        the engine has admitted it (nobody will consume it). Engine refusals become statuses (NoFreeBlocksError
        is raised instead with ``no_blocks_raises``: the caller waits for blocks)."""
        fut = asyncio.ensure_future(admit)
        self._admitting += 1
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._undo(f, undo))
            raise
        except InvalidRequestError as e:
            await errors.invalid(context, e.field, str(e))
        except NoFreeBlocksError as e:
            if no_blocks_raises:
                raise
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve KV blocks: {e}",
                               Reason.ERROR_REASON_OVERLOADED, "overloaded", retryable=True,
                               retry_after_ms=self.config.overload_retry_after_ms)
        except EngineDeadError as e:
            await errors.engine_dead(context, e)
        except ValueError as e:  # the prompt can never fit this pool
            await errors.fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve KV blocks: {e}",
                              Reason.ERROR_REASON_INVALID_INPUT, field="token_ids")
        finally:
            self._admitting -= 1
        raise AssertionError("unreachable")  # pragma: no cover

    def _undo(self, fut: asyncio.Future, undo: Callable[[], Awaitable[object]]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return  # nothing was admitted
        self.background(undo())

    # --- Reserve / RenewLease ---

    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        await self._router_only(context, "Reserve")
        wait_s = request.block_wait_ms / 1000 if self.config.reserve_wait_s > 0 else 0.0  # stall-bounded
        await self._admit(context, needs_blocks=wait_s <= 0)
        if not request.request_id:
            await errors.invalid(context, "request_id", "request_id: must not be empty")
        ids = request.token_ids[:]  # a list in one C copy (list() iterates the upb container)
        await self._check_prompt(context, ids)
        params = await self._params(context, request.params)
        deadline = request.deadline_unix
        if not math.isfinite(deadline) or deadline < 0:
            await errors.invalid(context, "deadline_unix", f"deadline_unix: must be a Unix time >= 0, got {deadline}")
        if deadline and deadline <= time.time():
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline_unix: the request's deadline "
                               "has already passed", Reason.ERROR_REASON_DEADLINE, "deadline", field="deadline_unix")
        caller = peer_identity(context)
        await self._within_share(context, caller, len(ids))
        rid = self.table.new_id()
        q, num_cached, block_ids = await self._reserve_blocks(context, rid, ids, params, deadline, wait_s)
        r = Reservation(rid, request.request_id, len(ids), params, block_ids, num_cached, q, deadline_unix=deadline,
                        caller=caller)
        self.table.add(r)
        self.leases.arm(r, request.lease_ms)
        resp = decode_pb2.ReserveResponse(
            reservation_id=rid, num_cached_blocks=num_cached, block_size=self.layout.block_size,
            layout=self._layout_pb, lease_expires_unix=r.lease_expires_unix, block_ids=block_ids,
            reservation_token=r.token, accepted_wire_fingerprints=self._wire_fingerprints)
        if self.destination is not None:  # a pool prefills may write into
            resp.destination.CopyFrom(self.destination)
        return resp

    async def _reserve_blocks(self, context: grpc.aio.ServicerContext, rid: str, ids: list[int],
                              params: SamplingParams, deadline_unix: float, wait_s: float) -> tuple:
        """The engine's reservation of the prompt's blocks. With too few free blocks, wait for them in arrival
        order, holding none: up to ``wait_s`` in all (the caller's block_wait_ms, within the call's and the
        request's deadline), and refused sooner once the queue stalls, when no waiting Reserve has got its
        blocks for --reserve-wait-s. A pool that turns over serves a long queue (its requests finish and free
        their blocks); one that does not is answered OVERLOADED, not waited on to the deadline."""
        def admit() -> Awaitable:
            return self._engine_admit(context, self.engine.reserve(rid, ids, params, detokenize=bool(params.stop)),
                                      lambda: self.drop(rid), no_blocks_raises=wait_s > 0)

        for bound in (context.time_remaining(), deadline_unix - time.time() if deadline_unix else None):
            if bound is not None:
                wait_s = min(wait_s, max(0.0, bound - 0.5))  # leave the answer time to travel
        need = -(-len(ids) // self.layout.block_size)
        if not self._block_queue and self.engine.published_stats().get("free_blocks", need) >= need:
            try:
                return await admit()
            except NoFreeBlocksError:
                pass  # taken meanwhile: wait for a turn
        stall_s = self.config.reserve_wait_s
        start = time.monotonic()
        end = start + wait_s
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self._block_queue:
            turn.set_result(None)
        self._block_queue.append(turn)
        self._block_queue_changed()
        stalled = False
        try:
            while True:
                now = time.monotonic()
                stall_at = max(start, self._queue_moved_at) + stall_s
                if now >= min(end, stall_at):
                    stalled = stall_at <= end
                    break
                if not turn.done():  # others ahead: sleep until our turn, or to re-read the stall clock
                    await asyncio.wait((turn,), timeout=min(end, stall_at) - now)
                    continue
                await self._still_admitting(context)  # the head ends at once on drain or engine death, then the next
                if self.engine.published_stats().get("free_blocks", 0) >= need:
                    try:
                        got = await admit()
                    except NoFreeBlocksError:
                        pass
                    else:
                        self._queue_moved_at = time.monotonic()
                        return got
                await asyncio.sleep(BLOCK_POLL_S)
        finally:
            head = self._block_queue[0] is turn
            self._block_queue.remove(turn)
            if head and self._block_queue and not self._block_queue[0].done():
                self._block_queue[0].set_result(None)
            self._block_queue_changed()
        self.metrics.requests_refused_total.labels("overloaded").inc()
        why = (f"and no waiting reservation got its blocks in {stall_s:.1f} s (--reserve-wait-s: the pool is not "
               "turning over)" if stalled else f"within {wait_s:.1f} s (block_wait_ms, the request's deadline)")
        await errors.fail(context, grpc.StatusCode.RESOURCE_EXHAUSTED,  # type: ignore[arg-type]
                          f"decode is overloaded: no {need} free KV blocks for this prompt {why}",
                          Reason.ERROR_REASON_OVERLOADED, retryable=True,
                          retry_after_ms=self.config.overload_retry_after_ms)
        raise AssertionError("unreachable")  # pragma: no cover

    def _block_queue_changed(self) -> None:
        self.metrics.waiting_for_blocks_requests.labels(self.model).set(len(self._block_queue))

    async def _still_admitting(self, context: grpc.aio.ServicerContext) -> None:
        """A Reserve waiting for blocks ends UNAVAILABLE (DRAINING, ENGINE_DEAD) once draining began or the engine
        died, rather than waiting for blocks that will not come."""
        if self.draining.is_set():
            self.metrics.requests_refused_total.labels("draining").inc()
            await abort_if_draining(context, self.draining, "decode")
        if self.engine.dead is not None:
            await errors.engine_dead(context, self.engine.dead)

    async def _within_share(self, context: grpc.aio.ServicerContext, caller: str, prompt_len: int) -> None:
        """Refuse a Reserve that would take ``caller``'s reservations awaiting KV past its share of the pool
        (reservations.caller_share), counting every block the prompt may need (cached ones included). A caller
        with nothing waiting is always let through (a prompt longer than a share still gets served); the
        engine still refuses it when no block is free."""
        total = int(self.engine.published_stats().get("total_blocks", 0))
        if total <= 0:
            return
        holders = self.table.blocks_awaiting_kv()
        share = caller_share(total, holders, caller)
        need = -(-prompt_len // self.layout.block_size)
        held = holders.get(caller, 0)
        if share >= total:  # the only caller waiting for KV: a full pool is the block wait's (or the engine's) answer
            return
        if held and held + need > share:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"decode is overloaded for this caller: its reservations waiting for KV hold {held} "
                               f"blocks, {need} more would pass its share of {share} of {total} blocks",
                               Reason.ERROR_REASON_OVERLOADED, "caller_share", retryable=True,
                               retry_after_ms=self.config.overload_retry_after_ms)

    async def drop(self, engine_rid: str) -> None:
        """Undo an admission whose caller went away."""
        self.engine.close_stream(engine_rid)
        try:
            await self.engine.abort(engine_rid)
        except EngineDeadError:
            pass

    async def RenewLease(self, request: decode_pb2.RenewLeaseRequest, context: grpc.aio.ServicerContext
                         ) -> decode_pb2.RenewLeaseResponse:
        """A fresh lease from now (capped like Reserve's). 0 when the KV has landed and a Generate stream
        has the request: no lease is needed any more."""
        await self._router_only(context, "RenewLease")
        if self.engine is None:
            await errors.loading(context)
        r = self.table.get(request.reservation_id)
        if r is None:
            await errors.gone(context, request.reservation_id)
        if not r.token_ok(request.reservation_token):
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "reservation_token: wrong or missing for "
                               f"reservation {r.reservation_id!r}", Reason.ERROR_REASON_PERMISSION, "permission",
                               field="reservation_token")
        if r.complete and r.streaming:
            return decode_pb2.RenewLeaseResponse(lease_expires_unix=0.0)
        return decode_pb2.RenewLeaseResponse(lease_expires_unix=self.leases.set_lease(r, request.lease_ms))

    def _lease_ended(self, r: Reservation, cause: EndCause) -> None:
        if cause is EndCause.EXPIRED and not r.complete:
            self.metrics.reservations_expired_total.labels(self.model).inc()

    def _landed(self, r: Reservation, last: common_pb2.KVChunk) -> None:
        self.leases.landed(r)
        self.metrics.kv_wait_seconds.labels(self.model).observe(r.kv_done_at - r.reserved_at)
        if last.prefill_done_unix:
            self.metrics.kv_transfer_exposed_seconds.labels(self.model).observe(
                max(0.0, time.time() - last.prefill_done_unix))

    # --- PushKV ---

    async def PushKV(self, request_iterator: AsyncIterator[common_pb2.KVChunk | WireChunk],
                     context: grpc.aio.ServicerContext) -> decode_pb2.PushKVResponse:
        if self.engine is None:
            await errors.loading(context)
        if not peer_may_write_kv(context, self.config.tls_enabled):
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED, "only a peer with a prefill certificate "
                               "may push KV", Reason.ERROR_REASON_PERMISSION, "permission")
        transport = registry.DEFAULT.name

        async def counted() -> AsyncIterator[common_pb2.KVChunk | WireChunk]:  # WireChunk: add_decode_servicer
            nonlocal transport
            async for c in request_iterator:
                transport = registry.label(c.transport)
                yield c

        with tracing.span_from_metadata("decode.kv_push", context.invocation_metadata()):
            try:
                resp = await self.receiver.receive(counted(), on_claimed=lambda: context.send_initial_metadata(CLAIM_ACK))
            except KVRejected as e:
                await errors.fail(context, e.code, str(e), e.detail_reason, retryable=e.retryable, field=e.field)
            except EngineDeadError as e:
                await errors.engine_dead(context, e)
            except Exception as e:  # the request stream broke; the reservation is kept for a retry
                await errors.fail(context, grpc.StatusCode.ABORTED, f"KV stream broke ({e!r}); the reservation "
                                  "is kept: resend from chunk 0", Reason.ERROR_REASON_KV_HANDOFF_FAILED,
                                  retryable=True)
        self.metrics.kv_chunks_received_total.labels(transport).inc(resp.chunks_received)
        self.metrics.kv_received_bytes_total.labels(transport).inc(resp.bytes_received)
        return resp

    # --- Generate / Stream ---

    async def Generate(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        await self._router_only(context, "Generate")
        if not request.reservation_id:  # a new colocated request: admission applies
            async for msg in self._colocated(request, context):
                yield msg
            return
        r = await self.attach(request, context)
        self.generating += 1
        finished = False
        with tracing.span_from_metadata("decode.generate", context.invocation_metadata(),
                                        request_id=r.request_id):
            try:
                async for o in self._stream(r.reservation_id, r.stream, r, abort_on_exit=False):
                    if o.finished and o.finish_reason == FinishReason.ABORT and r.end_cause is not None:
                        await errors.ended(context, r.reservation_id, r.end_cause)
                    finished = o.finished
                    yield fill_response(common_pb2.GenerateResponse(), r.request_id, o)
            except EngineDeadError as e:
                await errors.engine_dead(context, e)
            finally:
                self.generating -= 1
                if finished:
                    self.table.remove(r)
                else:  # the consumer left or the stream failed: free what the request holds
                    await self.receiver.release(r, EndCause.ABORTED)

    async def Stream(self, request_iterator: AsyncIterator[decode_pb2.StreamControl],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[decode_pb2.StreamStep]:
        await self._router_only(context, "Stream")
        async with contextlib.aclosing(StepStream(self, context).run(request_iterator)) as steps:
            async for step in steps:
                yield step

    async def attach(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
                     ) -> Reservation:
        """Generate's checks for a reserved request; the reservation is then marked as streamed."""
        if self.engine is None:  # (an existing reservation is served while draining)
            await errors.loading(context)
        r = self.table.get(request.reservation_id)
        if r is None:
            await errors.gone(context, request.reservation_id)
        if r.streaming:
            await errors.fail(context, grpc.StatusCode.FAILED_PRECONDITION,
                              f"reservation {r.reservation_id} is already being streamed",
                              Reason.ERROR_REASON_INVALID_INPUT, field="reservation_id")
        r.streaming = True
        self.leases.picked_up(r)
        return r

    async def _stream(self, engine_rid: str, q: asyncio.Queue, reservation: Reservation | None,
                      abort_on_exit: bool = True) -> AsyncIterator[RequestOutput]:
        progress = TokenProgress(self.metrics, self.model, reservation)
        async for o in self.engine.stream(engine_rid, q, abort_on_exit):
            progress.observe(o, time.monotonic())
            yield o

    async def admit_colocated(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext,
                              request_id: str, rid: str, subscriber: StepSubscriber | None) -> asyncio.Queue | None:
        """Colocated mode: admit the prompt as engine request ``rid`` (never the caller's ``request_id``: it must
        not collide with another request's). Its outputs go to ``subscriber``, or to the queue returned."""
        await self._admit(context, needs_blocks=False)
        if self.config.mode != "colocated":
            await errors.invalid(context, "reservation_id",
                                 "reservation_id: required (this decode runs disaggregated; start it with "
                                 "--mode colocated to take prompts)")
        ids = list(request.token_ids)
        await self._check_prompt(context, ids)
        params = await self._params(context, request.params)
        q = self.engine.open_stream(rid) if subscriber is None else None
        if subscriber is not None:
            self.engine.route_to(rid, subscriber)
        try:
            await self._engine_admit(context, self.engine.add(rid, ids, params, bool(params.stop)),
                                      lambda: self.drop(rid))
        except BaseException:
            self.engine.close_stream(rid)
            raise
        self._colocated_ids[request_id] = rid
        return q

    def forget_colocated(self, request_id: str, rid: str) -> None:
        if self._colocated_ids.get(request_id) == rid:
            del self._colocated_ids[request_id]

    async def _colocated(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Colocated mode: this process runs prefill and decode for the prompt (the A/B baseline)."""
        request_id = request.request_id or uuid.uuid4().hex
        rid = "col-" + uuid.uuid4().hex
        q = await self.admit_colocated(request, context, request_id, rid, None)
        assert q is not None
        self.generating += 1
        with tracing.span_from_metadata("decode.generate", context.invocation_metadata(), request_id=request_id):
            try:
                async for o in self._stream(rid, q, None):
                    yield fill_response(common_pb2.GenerateResponse(), request_id, o)
            except EngineDeadError as e:
                await errors.engine_dead(context, e)
            finally:
                self.generating -= 1
                self.forget_colocated(request_id, rid)

    def background(self, coro: Awaitable[object]) -> None:
        """Run ``coro`` as a task kept until it ends (:meth:`close` waits for it)."""
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    # --- Abort ---

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        await self._router_only(context, "Abort")
        if self.engine is None:
            return common_pb2.AbortResponse(found=False)
        r = self.table.find(request.request_id)
        if r is not None:
            await self.receiver.release(r, EndCause.ABORTED)
            return common_pb2.AbortResponse(found=True)
        rid = self._colocated_ids.get(request.request_id)
        if rid is None:
            return common_pb2.AbortResponse(found=False)
        try:
            return common_pb2.AbortResponse(found=await self.engine.abort(rid))
        except EngineDeadError as e:
            await errors.engine_dead(context, e)

    # --- lifecycle ---

    async def drain(self) -> None:
        """Wait for open Generate streams and KV transfers in flight (the server bounds the wait)."""
        while (self.engine is not None and self.engine.dead is None  # noqa: ASYNC110 (bounded by the server)
               and (self.generating or any(self.receiver.poll(r) in (KVPoll.WAITING_FOR_INPUT, KVPoll.TRANSFERRING)
                                            for r in self.table.values()))):
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Shutdown: wait for background releases."""
        if self.engine is not None:
            await self.leases.close()
        if self._bg:
            await asyncio.gather(*self._bg, return_exceptions=True)
