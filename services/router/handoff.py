"""One P/D dispatch of a prompt: Reserve on a decode, Prefill with its destination, merged token stream.

0. Early prefill (``--early-prefill``, on by default): Prefill is sent at the same time as Reserve, without
   a reservation (``attach_id`` set, no decode named); prefill admits and computes at once and writes
   nothing until AttachReservation hands it the reservation (decode address included) once Reserve
   answered, so a Reserve retried on another decode never lets prefill write to the first. Every decode
   failing Reserve cancels the early Prefill (prefill frees everything). Not done while the last Reserve
   answer of the pool, within DECODE_FULL_MEMORY_S, was OVERLOADED, nor while a Reserve has been waiting at
   its decode for free KV blocks that long (or one that waited so long answered within it): prefill compute
   would be spent on a request that most likely gets 429, or whose computed prompt would sit in prefill's
   pool waiting for its turn at decode.
1. Reserve on decode (it allocates destination blocks, reports which prefix blocks it holds). A full
   (OVERLOADED), unreachable or departing decode is skipped for the next; when none is left the
   request fails ``resource_exhausted`` (with a retry-after) if any was only full, else ``unavailable``.
2. Open decode's token stream for that reservation, and at the same time
3. send Prefill with that destination (or AttachReservation to the early one). A prefill that dies or is
   full is retried on another with the full request and the SAME reservation (decode keeps it when a PushKV stream breaks); the router renews the lease every
   lease/3 while Prefill is in flight, so a long prefill queue does not expire it and a router that
   disappears lets it lapse. No prefill left: the request fails and its reservation is aborted.
4. The first token arrives with PrefillResponse or first on decode's stream, whichever is first;
   later tokens come from decode. Tokens are merged by output position, so none is sent twice.

A decode that dies (its stream fails UNAVAILABLE without a detail, ENGINE_DEAD, DRAINING) raises
:class:`DecodeLostError` out of the attempt; the caller migrates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import grpc

from services.common import tracing
from services.common.block_hash import block_hashes
from services.common.grpc_util import detail_of
from services.common.metrics import RouterMetrics
from services.common.pb import common_pb2, decode_pb2, prefill_pb2
from services.router.instances import Instance, InstancePool, Liveness, inflight
from services.router.pipeline import BackendError, TokenEvent
from services.router.policy import NoInstanceError, choose
from services.router.request_state import (
    CONTROL_TIMEOUT_S,
    DecodeLost,
    DecodeLostError,
    DecodeTokens,
    DispatchEvent,
    DispatchSettings,
    Failed,
    HandoffFailed,
    PrefillDone,
    RequestState,
    token_stream,
)
from services.router.rpc_failure import RpcFailure
from services.text.sampling_params import SamplingParams, TopLogprobs
from services.text.sampling_pb import params_to_pb

log = logging.getLogger(__name__)

DECODE_FULL_MEMORY_S = 1.0
"""How long a Reserve answered OVERLOADED turns early prefill off (seconds; a later successful Reserve
turns it back on)."""
LATE_PREFILL_WAIT_S = 1.0
"""Longest wait for PrefillResponse after decode's last message, for usage.cached_tokens (seconds)."""
_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length"}
_FINISH_NAMES = {v.number: v.name for v in common_pb2.FinishReason.DESCRIPTOR.values}


def finish_of(msg: common_pb2.GenerateResponse, where: str) -> str | None:
    """"stop" / "length" / None (not finished). Any other ending (ABORT: lease ran out, the service
    gave the request up) is a failure, never a successful completion."""
    if msg.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
        return None
    reason = _FINISH.get(msg.finish_reason)
    if reason is None:
        name = _FINISH_NAMES.get(msg.finish_reason, str(msg.finish_reason))
        raise BackendError("unavailable", f"{where} ended the request without completing it ({name})")
    return reason


RESTART_POLL_S = 0.25
"""How often a dispatch step with no live instance probes the dead ones while it waits (seconds)."""


async def pick(pool: InstancePool, settings: DispatchSettings, hashes: list[bytes], exclude: set[str],
               last: RpcFailure | None, st: RequestState, metrics: RouterMetrics) -> Instance:
    """An instance to try; when none is left, the error the client gets.

    When no instance is left to try and some are not healthy (dead, suspect, not checked yet), the step waits, up
    to --restart-wait-s and within the request's deadline, for one to come back: the pool probes them
    every RESTART_POLL_S, and an instance back since the wait began may be tried again even if it
    failed this request before (a restarted process)."""
    try:
        return choose(pool, settings.policy, hashes, exclude, prefix_credit=settings.prefix_credit)
    except NoInstanceError as e:
        why = str(e)
    if all(i.state == Liveness.HEALTHY for i in pool.instances.values()):  # nothing to come back
        raise exhausted(pool.role, last, why)
    since = time.monotonic()
    until = since + min(settings.restart_wait_s, max(0.0, st.remaining_s()))
    while time.monotonic() < until:
        await pool.probe_for_return(exclude)
        back = {a for a, i in pool.instances.items() if i.back_at >= since}
        try:
            inst = choose(pool, settings.policy, hashes, exclude - back, prefix_credit=settings.prefix_credit)
        except NoInstanceError as e:
            why = str(e)
            await asyncio.sleep(max(0.0, min(RESTART_POLL_S, until - time.monotonic())))
            continue
        metrics.instance_waits_total.labels(pool.role, "back").inc()
        log.info("%s %s is back after %.1fs; request %s goes on there", pool.role, inst.address,
                 time.monotonic() - since, st.request_id)
        return inst
    if until > since:
        metrics.instance_waits_total.labels(pool.role, "gave_up").inc()
        why += f" (waited {until - since:.1f}s for one to come back)"
    raise exhausted(pool.role, last, why)


def exhausted(role: str, last: RpcFailure | None, why: str) -> BackendError:
    if last is not None and last.overloaded:
        return BackendError("resource_exhausted", f"every {role} instance is full ({last.where}: {last.message})",
                            retry_after_s=last.retry_after_s)
    suffix = f"; last failure: {last.where}: {last.code.name} {last.message}" if last is not None else ""
    return BackendError("unavailable", why + suffix)


class Handoff:
    """P/D attempts; one object per router, per-request state in :class:`RequestState`."""

    def __init__(self, prefill: InstancePool, decode: InstancePool, settings: DispatchSettings,
                 metrics: RouterMetrics, spawn: Callable[[Awaitable[object]], object]) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.s = settings
        self.metrics = metrics
        self._spawn = spawn
        """Runs a coroutine in a task the backend owns (aborts that must outlive the request)."""
        self._decode_full_at = -math.inf
        """When a decode last answered Reserve OVERLOADED, or a Reserve that had waited for free blocks for
        DECODE_FULL_MEMORY_S or more answered (monotonic s; -inf: a later Reserve succeeded at once)."""
        self._block_waits: dict[object, float] = {}
        """Reserves in flight that asked to wait for free KV blocks -> when each was sent (monotonic s), oldest
        first (a dict keeps insertion order)."""

    async def attempt(self, st: RequestState, prompt: list[int], params: SamplingParams
                      ) -> AsyncIterator[TokenEvent]:
        """Token events of ``prompt`` (output positions from 0); raises BackendError or DecodeLostError."""
        hashes = block_hashes(prompt, self.s.block_size)
        early = self.s.early_prefill and not self._decode_full()
        reserved: asyncio.Future[tuple[Instance, decode_pb2.ReserveResponse]] = (
            asyncio.get_running_loop().create_future())
        events: asyncio.Queue[DispatchEvent] = asyncio.Queue()
        prefill_over = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        decode: Instance | None = None
        resv: decode_pb2.ReserveResponse | None = None
        finished = False
        try:
            if early:  # computes while Reserve is in flight; gets the reservation with AttachReservation
                tasks.append(asyncio.create_task(self._prefill(st, prompt, params, hashes, reserved, events,
                                                               prefill_over, early=True)))
            decode, resv = await self._reserve(st, prompt, params, hashes)
            reserved.set_result((decode, resv))
            self._phase(st, "reserve")
            st.target = (decode, resv.reservation_id)
            tasks.append(asyncio.create_task(self._decode_stream(st, decode, resv, events)))
            if not early:
                tasks.append(asyncio.create_task(self._prefill(st, prompt, params, hashes, reserved, events,
                                                               prefill_over, early=False)))
            tasks.append(asyncio.create_task(self._renew(st, decode, resv, prefill_over)))
            with inflight(decode):
                emitted = 0
                from_decode = False  # decode's stream has delivered: the KV landed, prefill's fate no longer matters
                cached: int | None = None  # prompt tokens prefill did not compute; None until it answers
                while True:
                    ev = await events.get()
                    if isinstance(ev, Failed):
                        if ev.side == "prefill" and from_decode:
                            continue
                        raise ev.error
                    if isinstance(ev, DecodeLost):
                        raise DecodeLostError(decode.address, f"{ev.failure.code.name} {ev.failure.message}")
                    if isinstance(ev, HandoffFailed):
                        if from_decode:
                            continue
                        if not await self.decode_pool.probe(decode):
                            raise DecodeLostError(decode.address, f"{ev.failure.where}: {ev.failure.message}")
                        raise ev.failure.error()
                    if isinstance(ev, PrefillDone):
                        # Prompt tokens prefill did not compute (its cache + kvstore). Blocks decode
                        # already held were computed or loaded by prefill all the same: not counted.
                        cached = ev.resp.num_cached_tokens
                        if emitted == 0:
                            emitted = 1
                            self._phase(st, "first_token")
                            yield TokenEvent([ev.resp.first_token],
                                             [ev.resp.first_logprob if params.logprobs else None],
                                             prompt_tokens=len(prompt), cached_tokens=cached,
                                             top_logprobs=[top_of(ev.resp.first_top_logprobs)])
                        continue
                    from_decode = True
                    msg = ev.msg
                    reason = finish_of(msg, f"decode {decode.address}")
                    skip = max(0, emitted - ev.start)
                    new = list(msg.token_ids)[skip:]
                    lps: list[float | None] = list(msg.logprobs)[skip:] if msg.logprobs else [None] * len(new)
                    emitted = max(emitted, ev.start + len(msg.token_ids))
                    finished = reason is not None  # set before the yield: the consumer may close us there
                    if new and emitted == len(new):
                        self._phase(st, "first_token")
                    if finished and cached is None:
                        cached = await _late_prefill_report(events, prefill_over)
                    if new or reason:
                        yield TokenEvent(new, lps, finish_reason=reason, prompt_tokens=len(prompt),
                                         cached_tokens=cached or 0,
                                         top_logprobs=[top_of(t) for t in msg.top_logprobs][skip:])
                    if finished:
                        return
        finally:
            for t in tasks:  # an early Prefill still waiting for its reservation is cancelled: prefill frees it
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            reserved.cancel()
            st.target = None
            if decode is not None and resv is not None and not finished:
                self._spawn(abort_quietly(decode, resv.reservation_id, "router"))

    def _phase(self, st: RequestState, phase: str) -> None:
        """Observe the time from the request's arrival to ``phase`` of its handoff, once per request."""
        if phase in st.phases:
            return
        st.phases.add(phase)
        self.metrics.handoff_phase_seconds.labels(phase).observe(time.monotonic() - st.arrived)

    def _decode_full(self) -> bool:
        """The pool was full moments ago: a Reserve answered OVERLOADED or after waiting for free blocks within
        DECODE_FULL_MEMORY_S, or one has been waiting for blocks at least that long."""
        now = time.monotonic()
        oldest = next(iter(self._block_waits.values()), now)
        return now - self._decode_full_at < DECODE_FULL_MEMORY_S or now - oldest >= DECODE_FULL_MEMORY_S

    # --- 1. Reserve ---

    async def _reserve(self, st: RequestState, prompt: list[int], params: SamplingParams, hashes: list[bytes]
                       ) -> tuple[Instance, decode_pb2.ReserveResponse]:
        tried = set(st.lost)
        last: RpcFailure | None = None
        for _ in range(self.s.max_retries + 1):
            decode = await pick(self.decode_pool, self.s, hashes, tried, last, st, self.metrics)
            wait_ms = self._block_wait_ms(st, tried | {decode.address})
            sent = time.monotonic()
            try:
                with tracing.span("router.reserve", decode=decode.address), self._waiting(sent, wait_ms):
                    resv = await decode.decode.Reserve(decode_pb2.ReserveRequest(
                        request_id=st.request_id, token_ids=prompt, params=params_to_pb(params),
                        lease_ms=st.lease_ms(self.s), deadline_unix=st.deadline_unix, block_wait_ms=wait_ms),
                        timeout=st.timeout_s(CONTROL_TIMEOUT_S + wait_ms / 1000), metadata=tracing.inject_metadata())
                decode.remember(hashes)
                now = time.monotonic()
                self._decode_full_at = now if now - sent >= DECODE_FULL_MEMORY_S else -math.inf
                return decode, resv
            except grpc.aio.AioRpcError as e:
                last = RpcFailure.of(f"decode {decode.address} Reserve", e)
                if last.overloaded:
                    self._decode_full_at = time.monotonic()
                hung = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and st.remaining_s() > 0  # our cap, not the client's
                if not (last.retryable or hung):
                    raise last.error() from e
                last.note(self.decode_pool, decode)
                if hung:
                    self.decode_pool.report_unreachable(decode, f"{last.where}: no answer in {CONTROL_TIMEOUT_S:g}s")
                self.metrics.dispatch_retries_total.labels("decode", last.label).inc()
                tried.add(decode.address)
        raise exhausted("decode", last, f"{self.s.max_retries + 1} decode instances failed Reserve")

    @contextlib.contextmanager
    def _waiting(self, sent: float, wait_ms: int) -> Iterator[None]:
        """A Reserve in flight that asked to wait ``wait_ms`` for free blocks, in `_block_waits` while it is."""
        key = object()
        if wait_ms:
            self._block_waits[key] = sent
        try:
            yield
        finally:
            self._block_waits.pop(key, None)

    def _block_wait_ms(self, st: RequestState, tried: set[str]) -> int:
        """How long a Reserve may wait at its decode for free KV blocks: 0 while another healthy decode is left to
        try (a full one passes the request on), else --block-wait-s within the request's deadline."""
        if any(a not in tried and i.state == Liveness.HEALTHY for a, i in self.decode_pool.instances.items()):
            return 0
        return int(1000 * max(0.0, min(self.s.block_wait_s, st.remaining_s() - 1.0)))

    # --- 2. decode's token stream ---

    async def _decode_stream(self, st: RequestState, decode: Instance, resv: decode_pb2.ReserveResponse,
                             events: asyncio.Queue[DispatchEvent]) -> None:
        start = 0
        first = True
        try:
            req = decode_pb2.DecodeGenerateRequest(reservation_id=resv.reservation_id)
            async with token_stream(decode, req, self.s, metadata=st.metadata, timeout_s=st.timeout_s()) as call:
                async for msg in call:
                    if first:
                        first = False
                        self._phase(st, "decode_first")
                    await events.put(DecodeTokens(start, msg))
                    start += len(msg.token_ids)
            await events.put(Failed(BackendError("internal", f"decode {decode.address} ended the stream "
                                                             "without a finish reason"), "decode"))
        except grpc.aio.AioRpcError as e:
            f = RpcFailure.of(f"decode {decode.address} Generate", e)
            f.note(self.decode_pool, decode)
            await events.put(DecodeLost(f) if f.instance_lost else Failed(f.error(), "decode"))
        except BackendError as e:
            await events.put(Failed(e, "decode"))

    # --- 3. Prefill, retried with the same reservation ---

    async def _prefill(self, st: RequestState, prompt: list[int], params: SamplingParams, hashes: list[bytes],
                       reserved: asyncio.Future[tuple[Instance, decode_pb2.ReserveResponse]],
                       events: asyncio.Queue[DispatchEvent], over: asyncio.Event, *, early: bool) -> None:
        """Prefill until one answers. ``early``: the first call goes out before ``reserved`` is known and gets
        it with AttachReservation; retries wait for it and carry it in the request."""
        tried: set[str] = set()
        last: RpcFailure | None = None
        try:
            for attempt in range(self.s.max_retries + 1):
                prefill = await pick(self.prefill_pool, self.s, hashes, tried, last, st, self.metrics)
                try:
                    with inflight(prefill), tracing.span("router.prefill", prefill=prefill.address,
                                                         early=early and attempt == 0):
                        if early and attempt == 0:
                            req = self._prefill_request(st, prompt, params, None)
                            req.attach_id = uuid.uuid4().hex
                            resp = await self._early_call(st, prefill, req, reserved)
                        else:
                            req = self._prefill_request(st, prompt, params, await asyncio.shield(reserved))
                            req.sent_unix = time.time()
                            self._phase(st, "prefill_sent")
                            resp = await prefill.prefill.Prefill(req, metadata=tracing.inject_metadata(),
                                                                 timeout=st.timeout_s())
                    self._phase(st, "prefill_response")
                    prefill.remember(hashes)
                    await events.put(PrefillDone(resp))
                    return
                except grpc.aio.AioRpcError as e:
                    last = RpcFailure.of(f"prefill {prefill.address}", e)
                    if last.handoff_failed:
                        await events.put(HandoffFailed(last))
                        return
                    if not last.retryable:
                        raise last.error() from e
                    last.note(self.prefill_pool, prefill)
                    log.warning("%s failed (%s %s); retrying request %s on another prefill with the same "
                                "reservation", last.where, last.code.name, last.label, st.request_id)
                    self.metrics.dispatch_retries_total.labels("prefill", last.label).inc()
                    tried.add(prefill.address)
            raise exhausted("prefill", last, f"{self.s.max_retries + 1} prefill instances failed")
        except BackendError as e:
            await events.put(Failed(e, "prefill"))
        finally:
            over.set()

    def _prefill_request(self, st: RequestState, prompt: list[int], params: SamplingParams,
                         reserved: tuple[Instance, decode_pb2.ReserveResponse] | None) -> prefill_pb2.PrefillRequest:
        """A PrefillRequest with the reservation's fields (None: none, an early Prefill)."""
        req = prefill_pb2.PrefillRequest(request_id=st.request_id, token_ids=prompt, params=params_to_pb(params),
                                         deadline_unix=st.deadline_unix)
        if reserved is not None:
            _set_reservation(req, *reserved)
        if self.s.chunked_transfer is not None:
            req.chunked_transfer = self.s.chunked_transfer
        return req

    async def _early_call(self, st: RequestState, prefill: Instance, req: prefill_pb2.PrefillRequest,
                          reserved: asyncio.Future[tuple[Instance, decode_pb2.ReserveResponse]]
                          ) -> prefill_pb2.PrefillResponse:
        """An early Prefill and, once Reserve answered, its AttachReservation. A refused attach ends the call
        (its error is raised), except one refused because the Prefill call already ended: that call's own
        status decides (a retryable failure is retried, an internal one stays internal)."""
        req.sent_unix = time.time()
        self._phase(st, "prefill_sent")
        call = prefill.prefill.Prefill(req, metadata=tracing.inject_metadata(), timeout=st.timeout_s())
        answer = asyncio.ensure_future(call)
        attach = asyncio.ensure_future(self._attach(st, prefill, req.attach_id, reserved))
        try:
            await asyncio.wait({answer, attach}, return_when=asyncio.FIRST_COMPLETED)
            refused = None if answer.done() else attach.exception()
            if refused is not None and not _call_ended(refused):
                raise refused
            return await answer
        finally:
            call.cancel()  # a no-op once it answered; else prefill frees everything it held for it
            attach.cancel()
            await asyncio.gather(answer, attach, return_exceptions=True)

    async def _attach(self, st: RequestState, prefill: Instance, attach_id: str,
                      reserved: asyncio.Future[tuple[Instance, decode_pb2.ReserveResponse]]) -> None:
        decode, resv = await asyncio.shield(reserved)
        msg = prefill_pb2.AttachReservationRequest(request_id=st.request_id, attach_id=attach_id)
        _set_reservation(msg, decode, resv)
        with tracing.span("router.attach", prefill=prefill.address, decode=decode.address):
            await prefill.prefill.AttachReservation(msg, metadata=tracing.inject_metadata(),
                                                    timeout=st.timeout_s(CONTROL_TIMEOUT_S))
        self._phase(st, "attached")

    async def _renew(self, st: RequestState, decode: Instance, resv: decode_pb2.ReserveResponse,
                     prefill_over: asyncio.Event) -> None:
        """RenewLease every lease/3 until Prefill returns (its KV landed, or it failed for good)."""
        interval_s = st.lease_ms(self.s) / 3000.0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(prefill_over.wait(), interval_s)
                return
            try:
                await decode.decode.RenewLease(decode_pb2.RenewLeaseRequest(
                    reservation_id=resv.reservation_id, reservation_token=resv.reservation_token,
                    lease_ms=st.lease_ms(self.s)), timeout=st.timeout_s(min(interval_s, CONTROL_TIMEOUT_S)))
            except grpc.aio.AioRpcError as e:  # the decode stream reports a lost reservation or decode
                log.warning("decode %s RenewLease of %s failed: %s %s", decode.address, resv.reservation_id,
                            e.code().name, e.details())
            except BackendError:  # deadline passed: decode drops the reservation itself
                return


def _call_ended(err: BaseException) -> bool:
    """An AttachReservation refused because its Prefill call no longer waits for it (it ended, or never
    arrived): FAILED_PRECONDITION on field attach_id, not retryable."""
    if not isinstance(err, grpc.aio.AioRpcError) or err.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    d = detail_of(err)
    return d.field == "attach_id" and not d.retryable


def _set_reservation(msg: prefill_pb2.PrefillRequest | prefill_pb2.AttachReservationRequest, decode: Instance,
                     resv: decode_pb2.ReserveResponse) -> None:
    """The reservation fields (same names in both messages) from decode's Reserve answer."""
    msg.decode_address = decode.address
    msg.reservation_id = resv.reservation_id
    msg.num_skip_blocks = resv.num_cached_blocks
    msg.expected_layout_fingerprint = resv.layout.fingerprint
    msg.dest_block_ids.extend(resv.block_ids)
    msg.reservation_token = resv.reservation_token
    msg.accepted_wire_fingerprints.extend(resv.accepted_wire_fingerprints)
    if resv.HasField("destination"):
        msg.destination.CopyFrom(resv.destination)


def top_of(p: common_pb2.TopLogprobs) -> TopLogprobs | None:
    """Alternatives at one position (None for an empty message; a malformed one is cut to its
    shorter list)."""
    n = min(len(p.token_ids), len(p.logprobs))
    return TopLogprobs(tuple(p.token_ids[:n]), tuple(p.logprobs[:n])) if n else None


async def _late_prefill_report(events: asyncio.Queue[DispatchEvent], prefill_over: asyncio.Event) -> int | None:
    """Prefill's cached-token count when decode's last message beat PrefillResponse (decode acks the last
    KV chunk, then prefill answers: milliseconds apart). Waits at most LATE_PREFILL_WAIT_S; None if
    prefill never answered."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(prefill_over.wait(), LATE_PREFILL_WAIT_S)
    while not events.empty():
        ev = events.get_nowait()
        if isinstance(ev, PrefillDone):
            return ev.resp.num_cached_tokens
    return None


async def abort_quietly(inst: Instance, key: str, why: str) -> None:
    """Abort ``key`` (reservation or request id) on ``inst``; failures are logged, never raised."""
    try:
        await inst.decode.Abort(common_pb2.AbortRequest(request_id=key, reason=why), timeout=CONTROL_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        log.info("Abort of %s on %s failed: %s", key, inst.address, e.code().name)
