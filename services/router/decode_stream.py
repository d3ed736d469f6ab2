"""The router's side of Decode.Stream: one long-lived bidirectional stream per decode instance.

Every request this router runs on an instance is started on that instance's stream under a key, and
read back as the GenerateResponse messages a Generate call would have yielded: one reader task takes
each StreamStep (one per engine step) apart and hands every request its entries. A request's failure
is raised as the grpc.aio.AioRpcError its Generate call would have raised (same status code, the
decode's ErrorDetail in the trailing metadata), so dispatch decides on it the same way. A stream that
breaks (decode died, the channel went away) fails every request on it with the stream's own error, and
the next request opens a new stream. Leaving a request before it finished sends a cancel for its key at
once. The request's deadline is kept here (a stream has none of its own): past it, the request is
cancelled and fails DEADLINE_EXCEEDED, as a Generate call with that timeout does.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from services.common.grpc_util import ERROR_DETAIL_KEY
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}

Item = common_pb2.GenerateResponse | grpc.aio.AioRpcError
"""What a request's queue carries: its next message, or the error that ends it."""


def _error_of(e: decode_pb2.StreamError) -> grpc.aio.AioRpcError:
    trailing = grpc.aio.Metadata((ERROR_DETAIL_KEY, e.detail.SerializeToString()))
    return grpc.aio.AioRpcError(_CODES.get(e.code, grpc.StatusCode.UNKNOWN), grpc.aio.Metadata(), trailing,
                                details=e.message)


def _copy(e: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """The stream's error for one of its requests (each raises its own instance)."""
    return grpc.aio.AioRpcError(e.code(), e.initial_metadata(), e.trailing_metadata(), details=e.details(),
                                debug_error_string=e.debug_error_string())


@dataclass(eq=False)
class _Connection:
    """One Decode.Stream call and the requests started on it."""

    address: str
    sends: asyncio.Queue[decode_pb2.StreamControl | None] = field(default_factory=asyncio.Queue)
    """Control messages to send, in order; None half-closes the stream."""
    open: dict[int, asyncio.Queue[Item]] = field(default_factory=dict)
    """Requests started and not ended, by key."""
    broken: grpc.aio.AioRpcError | None = None
    reader: asyncio.Task | None = None

    async def controls(self) -> AsyncIterator[decode_pb2.StreamControl]:
        while True:
            msg = await self.sends.get()
            if msg is None:
                return
            yield msg

    async def read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for step in call:
                opened = self.open
                for t in step.tokens:
                    q = opened.get(t.key)
                    if q is not None:
                        q.put_nowait(t.response)
                        if t.response.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                            del opened[t.key]  # decode forgot the key with its last message
                for e in step.errors:
                    q = opened.pop(e.key, None)
                    if q is not None:
                        q.put_nowait(_error_of(e))
            self.broken = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details=f"decode {self.address} ended its token stream")
        except grpc.aio.AioRpcError as e:
            self.broken = e
        except asyncio.CancelledError:
            call.cancel()
            self.broken = grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                               details="the router closed its token stream")
            raise
        finally:
            self.sends.put_nowait(None)
            if self.open:
                log.warning("decode %s token stream ended (%s %s) under %d requests", self.address,
                            self.broken.code().name if self.broken else "?",
                            self.broken.details() if self.broken else "", len(self.open))
            broken = self.broken or grpc.aio.AioRpcError(grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(),
                                                         grpc.aio.Metadata(), details="token stream reader failed")
            self.broken = broken
            for q in self.open.values():
                q.put_nowait(_copy(broken))
            self.open.clear()


def _coalesce(first: common_pb2.GenerateResponse, q: asyncio.Queue[Item]
              ) -> tuple[common_pb2.GenerateResponse, grpc.aio.AioRpcError | None]:
    """``first`` and every message queued behind it as one message (token ids, logprobs and alternatives in
    order; the finish reason and usage of the last), and the error that ended the queue, if one did. A
    consumer that fell behind (a busy router) catches up in one pass and one client write instead of one per
    step: its cost per token falls as its lag grows."""
    merged = common_pb2.GenerateResponse()
    merged.MergeFrom(first)
    while not q.empty():
        nxt = q.get_nowait()
        if isinstance(nxt, grpc.aio.AioRpcError):
            return merged, nxt
        merged.MergeFrom(nxt)
        if nxt.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            break
    return merged, None


class DecodeStreams:
    """The token stream to one decode instance (opened on first use, reopened after it breaks)."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self._stub = decode_pb2_grpc.DecodeStub(channel)
        self.address = address
        self._conn: _Connection | None = None
        self._keys = itertools.count(1)

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.broken is not None or conn.reader is None or conn.reader.done():
            conn = self._conn = _Connection(self.address)
            call = self._stub.Stream(conn.controls())
            conn.reader = asyncio.ensure_future(conn.read(call))
        return conn

    async def generate(self, request: decode_pb2.DecodeGenerateRequest, *,
                       metadata: Sequence[tuple[str, str]] = (), timeout_s: float | None = None
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """What ``Decode.Generate(request, metadata=..., timeout=timeout_s)`` yields, over this instance's stream."""
        conn = self._connection()
        key = next(self._keys)
        q: asyncio.Queue[Item] = asyncio.Queue()
        conn.open[key] = q
        conn.sends.put_nowait(decode_pb2.StreamControl(start=decode_pb2.StreamStart(
            key=key, request=request, trace=dict(metadata))))
        timer = None
        if timeout_s is not None:
            timer = asyncio.get_running_loop().call_later(max(0.0, timeout_s), self._expire, conn, key, q)
        try:
            while True:
                item = await q.get()
                if isinstance(item, grpc.aio.AioRpcError):
                    raise item
                ended: grpc.aio.AioRpcError | None = None
                if not q.empty() and item.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                    item, ended = _coalesce(item, q)
                yield item
                if item.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    return
                if ended is not None:
                    raise ended
        finally:
            if timer is not None:
                timer.cancel()
            if conn.open.pop(key, None) is not None and conn.broken is None:  # left early: free it at once
                conn.sends.put_nowait(decode_pb2.StreamControl(cancel=decode_pb2.StreamCancel(key=key)))

    @staticmethod
    def _expire(conn: _Connection, key: int, q: asyncio.Queue[Item]) -> None:
        if conn.open.pop(key, None) is None:
            return
        conn.sends.put_nowait(decode_pb2.StreamControl(cancel=decode_pb2.StreamCancel(key=key)))
        q.put_nowait(grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                          details="Deadline Exceeded"))

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None or conn.reader is None:
            return
        conn.sends.put_nowait(None)
        conn.reader.cancel()
        await asyncio.gather(conn.reader, return_exceptions=True)
