"""Decode.Stream: one router's requests over one bidirectional stream.

The router sends StreamControl messages (start a reserved or colocated request under a key of its own,
cancel a key); decode answers with one StreamStep per engine step holding every new token of that step
for every request of the stream, plus a StreamError for each request that failed where its own Generate
stream would have ended with a status. The engine hands the stream a step's outputs as one StepBatch (its
requests are routed to one StepSubscriber), and whatever is queued when the writer wakes (several steps,
errors) leaves as one message.

Each request runs the checks of Generate against a :class:`RequestContext`: a check that fails ends that
request only, with the status, message and ErrorDetail its Generate stream would carry. A cancel frees the
request at once (as a Generate consumer leaving does); the stream ending, for any reason, frees every
request still on it; the engine dying ends the stream with ENGINE_DEAD.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import grpc

from services.common import tracing
from services.common.grpc_util import ERROR_DETAIL_KEY, Reason, error_detail
from services.common.pb import common_pb2, decode_pb2
from services.decode import errors
from services.decode.progress import TokenProgress, fill_response
from services.decode.reservations import EndCause, Reservation
from services.engine.async_engine import EngineDeadError, StepBatch, StepSubscriber
from services.engine.sequence import FinishReason

if TYPE_CHECKING:  # the servicer builds a StepStream per call; only its type is needed here
    from services.decode.servicer import DecodeServicer


class RequestAborted(Exception):
    """A check of one request on a Stream failed: what its Generate stream would have ended with."""

    def __init__(self, code: grpc.StatusCode, message: str, detail: common_pb2.ErrorDetail) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.detail = detail


class RequestContext:
    """The servicer context one request of a Stream runs Generate's checks against: its tracing metadata
    is the request's own, and ``abort`` raises :class:`RequestAborted` (ending this request, not the stream)."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._trailing: Iterable[tuple[str, Any]] = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, Any]]) -> None:
        self._trailing = metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> NoReturn:
        detail = common_pb2.ErrorDetail()
        for key, value in (*self._trailing, *(trailing_metadata or ())):
            if key == ERROR_DETAIL_KEY:
                detail.ParseFromString(value)
        raise RequestAborted(code, details, detail)


@dataclass(eq=False, slots=True)
class _Member:
    """A request started on this stream (per-request state lives here)."""

    key: int
    request_id: str
    """The router's request id (GenerateResponse.request_id)."""
    rid: str
    """The engine's request id (a reservation id, or a colocated id decode picked)."""
    reservation: Reservation | None
    progress: TokenProgress
    span: Any


@dataclass(frozen=True, slots=True)
class _Failed:
    """A request that ended with an error before or between steps."""

    key: int
    error: RequestAborted


@dataclass(frozen=True, slots=True)
class _ReaderDone:
    """The router closed its side of the stream (or it broke): the stream ends."""


@dataclass(eq=False)
class StepStream:
    svc: DecodeServicer
    context: grpc.aio.ServicerContext
    sub: StepSubscriber = field(default_factory=StepSubscriber)
    members: dict[str, _Member] = field(default_factory=dict)
    """Running requests by engine request id."""
    keys: dict[int, _Member] = field(default_factory=dict)
    starting: dict[int, asyncio.Task] = field(default_factory=dict)
    """Starts still running their checks or admission, by key."""

    async def run(self, requests: AsyncIterator[decode_pb2.StreamControl]) -> AsyncIterator[decode_pb2.StreamStep]:
        reader = asyncio.ensure_future(self._read(requests))
        q = self.sub.queue
        try:
            while True:
                step = decode_pb2.StreamStep()
                done = self._take(await q.get(), step)
                while not done and not q.empty():
                    done = self._take(q.get_nowait(), step)
                if step.tokens or step.errors:
                    yield step
                if done:
                    return
        except EngineDeadError as e:
            await errors.engine_dead(self.context, e)
        finally:
            # Everything still on the stream is freed before the first await: a second cancellation of the
            # handler (grpc cancelling the call again while this cleanup waits) must not leave requests behind.
            reader.cancel()
            starts = list(self.starting.values())
            for t in starts:
                t.cancel()
            for m in list(self.keys.values()):
                self._end(m, finished=False)
            await asyncio.gather(reader, *starts, return_exceptions=True)
            for m in list(self.keys.values()):  # joined by a start while it was being cancelled
                self._end(m, finished=False)

    # --- router -> decode ---

    async def _read(self, requests: AsyncIterator[decode_pb2.StreamControl]) -> None:
        try:
            async for ctl in requests:
                kind = ctl.WhichOneof("kind")
                if kind == "start":
                    key = ctl.start.key
                    if key in self.keys or key in self.starting:
                        self.sub.queue.put_nowait(_Failed(key, RequestAborted(
                            grpc.StatusCode.INVALID_ARGUMENT, f"key: {key} is already in use on this stream",
                            error_detail(Reason.ERROR_REASON_INVALID_INPUT, side=errors.SIDE, field="key"))))
                        continue
                    self.starting[key] = asyncio.ensure_future(self._start(ctl.start))
                elif kind == "cancel":
                    self._cancel(ctl.cancel.key)
        finally:
            self.sub.queue.put_nowait(_ReaderDone())

    def _cancel(self, key: int) -> None:
        start = self.starting.get(key)
        if start is not None:
            start.cancel()
            return
        m = self.keys.get(key)
        if m is not None:
            self._end(m, finished=False)

    async def _start(self, start: decode_pb2.StreamStart) -> None:
        svc = self.svc
        req = start.request
        ctx = RequestContext(tuple(start.trace.items()))
        m: _Member | None = None
        try:
            if req.reservation_id:
                r = await svc.attach(req, ctx)  # type: ignore[arg-type]
                m = self._join(start, r.request_id, r.reservation_id, r)
                svc.engine.route_to(r.reservation_id, self.sub)
            else:
                m = self._join(start, req.request_id or uuid.uuid4().hex, "col-" + uuid.uuid4().hex, None)
                await svc.admit_colocated(req, ctx, m.request_id, m.rid, self.sub)  # type: ignore[arg-type]
        except RequestAborted as e:
            if m is not None:
                self._leave(m)
            self.sub.queue.put_nowait(_Failed(start.key, e))
        except EngineDeadError as e:
            if m is not None:
                self._end(m, finished=False)
            self.sub.queue.put_nowait(e)
        except asyncio.CancelledError:
            if m is not None:
                self._end(m, finished=False)
            raise
        finally:
            self.starting.pop(start.key, None)

    def _join(self, start: decode_pb2.StreamStart, request_id: str, rid: str, r: Reservation | None) -> _Member:
        """Register a request before its first output can arrive."""
        svc = self.svc
        span = tracing.start_server_span("decode.generate", tuple(start.trace.items()), request_id=request_id)
        m = _Member(start.key, request_id, rid, r, TokenProgress(svc.metrics, svc.model, r), span)
        self.members[rid] = m
        self.keys[start.key] = m
        svc.generating += 1
        return m

    def _leave(self, m: _Member) -> None:
        """Unregister ``m`` (what it held is freed by whoever refused it)."""
        if self.keys.get(m.key) is not m:
            return
        del self.keys[m.key]
        self.members.pop(m.rid, None)
        self.svc.generating -= 1
        m.span.end()

    def _end(self, m: _Member, *, finished: bool) -> None:
        """The request left the stream; unless it finished, everything it holds is freed."""
        if self.keys.get(m.key) is not m:
            return
        self._leave(m)
        svc = self.svc
        svc.engine.close_stream(m.rid)
        r = m.reservation
        if r is not None:
            if finished:
                svc.table.remove(r)
            else:
                svc.background(svc.receiver.release(r, EndCause.ABORTED))
            return
        svc.forget_colocated(m.request_id, m.rid)
        if not finished:
            svc.background(svc.drop(m.rid))

    # --- decode -> router ---

    def _take(self, item: object, step: decode_pb2.StreamStep) -> bool:
        """Add a queued item to ``step``; True when the stream ends."""
        if isinstance(item, StepBatch):
            self._outputs(item, step)
            return False
        if isinstance(item, _Failed):
            self._error(step, item.key, item.error)
            return False
        if isinstance(item, _ReaderDone):
            return True
        if isinstance(item, BaseException):
            raise EngineDeadError(f"engine loop died: {item!r}")
        raise TypeError(f"unexpected item on a Stream queue: {item!r}")

    def _outputs(self, batch: StepBatch, step: decode_pb2.StreamStep) -> None:
        now = time.monotonic()
        members = self.members
        for o in batch.outputs:
            m = members.get(o.request_id)
            if m is None:  # cancelled meanwhile
                continue
            m.progress.observe(o, now)
            r = m.reservation
            if o.finished and o.finish_reason == FinishReason.ABORT and r is not None and r.end_cause is not None:
                self._error(step, m.key, RequestAborted(*errors.ended_status(r.reservation_id, r.end_cause)))
                self._end(m, finished=False)
                continue
            entry = step.tokens.add()
            entry.key = m.key
            fill_response(entry.response, m.request_id, o)
            if o.finished:
                self._end(m, finished=True)

    @staticmethod
    def _error(step: decode_pb2.StreamStep, key: int, e: RequestAborted) -> None:
        err = step.errors.add()
        err.key = key
        err.code = e.code.value[0]
        err.message = e.message
        err.detail.CopyFrom(e.detail)
