"""Client-side timers of the router: TTFT, ITL, e2e, request and token counters (DESIGN section 4)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from services.common.metrics import RouterMetrics
from services.router.pipeline import BackendError, TextDelta


async def metered(deltas: AsyncIterator[TextDelta], metrics: RouterMetrics, model: str, arrival: float
                  ) -> AsyncIterator[TextDelta]:
    """Pass deltas through, timing each token batch at the moment it is handed to the client writer.

    ``arrival`` is time.monotonic() when the request reached the router."""
    last: float | None = None
    status, reason = "error", ""
    metrics.inflight_requests.labels(model).inc()
    try:
        async with contextlib.aclosing(deltas):  # type: ignore[type-var]
            async for d in deltas:
                now = time.monotonic()
                if d.token_ids:
                    if last is None:
                        metrics.ttft_seconds.labels(model).observe(now - arrival)
                    else:
                        metrics.itl_seconds.labels(model).observe(now - last)
                    last = now
                    metrics.generation_tokens_total.labels(model).inc(len(d.token_ids))
                if d.finish_reason is not None:
                    status, reason = "ok", d.finish_reason
                    if d.usage is not None:
                        metrics.prompt_tokens_total.labels(model).inc(d.usage.prompt_tokens)
                yield d
    except BackendError as e:
        metrics.errors_total.labels(model, e.code).inc()
        raise
    except (GeneratorExit, asyncio.CancelledError):
        status, reason = "cancelled", "abort"
        raise
    finally:
        metrics.inflight_requests.labels(model).dec()
        metrics.e2e_seconds.labels(model).observe(time.monotonic() - arrival)
        metrics.requests_total.labels(model, status, reason).inc()
