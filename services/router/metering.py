"""Admission and accounting of client generation requests (HTTP and gRPC alike), and the client-side
timers: TTFT, ITL, e2e, request and token counters (docs/METRICS.md).

Every generation request opens one :class:`RequestRecord` (a context manager) and ends in exactly one
outcome, counted once in ``requests_total{status, finish_reason}``:

- ``ok``: the generation completed, finish_reason ``stop`` or ``length``;
- ``error``: refused or failed, finish_reason ``error``; also counted in ``errors_total{code}`` with a
  code from :data:`ERROR_CODES` (4xx included: a 400 is ``invalid_argument``, a 401 ``unauthenticated``);
- ``cancelled``: the client went away (closed the connection, cancelled the RPC), finish_reason
  ``cancelled``.

The first outcome set wins; a record closed without one takes it from the exception that closed it.

With ``access_log`` on, each closed record writes one INFO line to the ``pdserve.access`` logger:

    request id=chatcmpl-1f.. api=http wire=200 status=ok code=- finish_reason=stop prompt_tokens=42
        cached_tokens=32 completion_tokens=16 ttft_s=0.213 e2e_s=0.871

``wire`` is what the client got (HTTP status; for gRPC the status name), ``code`` the error code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from types import TracebackType

from services.common.logging import kv
from services.common.metric_series import ROUTER_ERROR_CODES
from services.common.metrics import RouterMetrics
from services.router.pipeline import DEFAULT_RETRY_AFTER_S, BackendError, TextDelta

log = logging.getLogger(__name__)
access_log = logging.getLogger("pdserve.access")

ERROR_CODES = ROUTER_ERROR_CODES
"""Values of errors_total's ``code`` label: lower-case gRPC status names, whichever API failed."""

_HTTP_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
               409: "already_exists", 429: "resource_exhausted", 500: "internal", 503: "unavailable",
               504: "deadline_exceeded"}


def code_for_http_status(status: int) -> str:
    """The :data:`ERROR_CODES` value of an HTTP error status (other 4xx: invalid_argument; 5xx: internal)."""
    return _HTTP_CODES.get(status, "invalid_argument" if status < 500 else "internal")


class RequestMeter:
    """Admission (at most ``max_inflight`` admitted requests) and accounting, shared by both APIs.

    ``metrics`` None: admission only (tests of the HTTP layer alone)."""

    def __init__(self, metrics: RouterMetrics | None, model: str, max_inflight: int = 256,
                 retry_after_s: float = DEFAULT_RETRY_AFTER_S, access_log: bool = False) -> None:
        if max_inflight <= 0:
            raise ValueError(f"max_inflight must be > 0, got {max_inflight}")
        self.metrics = metrics
        self.model = model
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.inflight = 0
        """Admitted requests not yet closed."""
        self.access_log = access_log

    def request(self, arrival: float | None = None, api: str = "http") -> RequestRecord:
        """A record for one request; ``arrival`` is time.monotonic() when it reached the router."""
        return RequestRecord(self, time.monotonic() if arrival is None else arrival, api)

    def _admit(self) -> None:
        if self.inflight >= self.max_inflight:
            raise BackendError("resource_exhausted", f"the router has {self.inflight} requests in flight "
                                                     f"(max_inflight_requests={self.max_inflight}); retry later",
                               retry_after_s=self.retry_after_s)
        self.inflight += 1
        if self.metrics is not None:
            self.metrics.inflight_requests.labels(self.model).inc()

    def _close(self, rec: RequestRecord) -> None:
        if self.access_log:
            rec.log_line()
        if rec.admitted:
            self.inflight -= 1
            if self.metrics is not None:
                self.metrics.inflight_requests.labels(self.model).dec()
        m = self.metrics
        if m is None or rec.status is None:
            return
        m.requests_total.labels(self.model, rec.status, rec.finish_reason).inc()
        if rec.status == "error":
            m.errors_total.labels(self.model, rec.code).inc()
        elif rec.status == "ok":
            m.e2e_seconds.labels(self.model).observe(time.monotonic() - rec.arrival)


class RequestRecord:
    """One request's admission ticket and outcome; use as ``with meter.request(t0) as rec:``."""

    def __init__(self, meter: RequestMeter, arrival: float, api: str = "http") -> None:
        self.meter = meter
        self.arrival = arrival
        self.api = api
        """http | grpc."""
        self.request_id = ""
        self.wire_status = ""
        """What the client got: the HTTP status, or the gRPC status name (set by the API layer)."""
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.ttft_s: float | None = None
        self.admitted = False
        self.status: str | None = None
        """ok | error | cancelled, once known."""
        self.finish_reason = ""
        self.code = ""
        """An ERROR_CODES value when status is error."""

    def admit(self) -> None:
        """Take an in-flight slot; BackendError("resource_exhausted") when the router is full."""
        if not self.admitted:
            self.meter._admit()
            self.admitted = True

    def ok(self, finish_reason: str) -> None:
        self._set("ok", finish_reason, "")

    def fail(self, code: str) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"error code must be one of {ERROR_CODES}, got {code!r}")
        self._set("error", "error", code)

    def cancel(self) -> None:
        self._set("cancelled", "cancelled", "")

    def _set(self, status: str, finish_reason: str, code: str) -> None:
        if self.status is None:
            self.status, self.finish_reason, self.code = status, finish_reason, code

    async def observe(self, deltas: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
        """Pass deltas through, timing each token batch as it is handed to the client writer; the
        final delta (finish_reason set) makes the outcome ok."""
        m, model = self.meter.metrics, self.meter.model
        # Children bound once per request: no label lookup (lock + dict) per token batch.
        itl = m.itl_seconds.labels(model) if m is not None else None
        generated = m.generation_tokens_total.labels(model) if m is not None else None
        last: float | None = None
        async with contextlib.aclosing(deltas):  # type: ignore[type-var]
            async for d in deltas:
                now = time.monotonic()
                if d.token_ids:
                    self.completion_tokens += len(d.token_ids)
                    if self.ttft_s is None:
                        self.ttft_s = now - self.arrival
                if m is not None and itl is not None and generated is not None and d.token_ids:
                    if last is None:
                        m.ttft_seconds.labels(model).observe(now - self.arrival)
                    else:
                        itl.observe(now - last)
                    last = now
                    generated.inc(len(d.token_ids))
                if d.usage is not None:
                    self.prompt_tokens, self.cached_tokens = d.usage.prompt_tokens, d.usage.cached_tokens
                if d.finish_reason is not None:
                    self.ok(d.finish_reason)
                    if m is not None and d.usage is not None:
                        m.prompt_tokens_total.labels(model).inc(d.usage.prompt_tokens)
                yield d

    def log_line(self) -> None:
        """The access-log line of this request (one INFO record on ``pdserve.access``)."""
        ttft = "-" if self.ttft_s is None else f"{self.ttft_s:.3f}"
        access_log.info("request", extra=kv(
            id=self.request_id or "-", api=self.api, wire=self.wire_status or "-", status=self.status or "error",
            code=self.code or "-", finish_reason=self.finish_reason or "-",
            prompt_tokens=self.prompt_tokens, cached_tokens=self.cached_tokens,
            completion_tokens=self.completion_tokens, ttft_s=ttft, e2e_s=f"{time.monotonic() - self.arrival:.3f}"))

    def __enter__(self) -> RequestRecord:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.status is None:
            if isinstance(exc, BackendError):
                self.fail(exc.code)
            elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
                self.cancel()
            else:
                if exc is None:
                    log.error("a request ended without an outcome; counted as an internal error")
                self.fail("internal")
        self.meter._close(self)
