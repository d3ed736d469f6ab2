"""Lease and deadline timers of decode reservations.

A lease bounds how long a reservation waits for its KV: Reserve's ``lease_ms`` (0: the server
default) capped and never past the request's ``deadline_unix``. The cap is ``--lease-ms`` while no KV
has arrived (the router asks for that lease and renews it every lease/3 while its prefill runs, so a
caller that never sends KV holds blocks one lease at most), ``--max-lease-ms`` once KV is arriving. A
huge ask (``lease_ms=4294967295``) is capped, not refused. RenewLease sets a fresh lease the same way. When
the lease runs out before the last KV chunk lands, the reservation is released (blocks freed). Once
the KV has landed, a request no Generate stream has picked up gets one more lease of the same length
to be picked up; then it is released too (nobody would ever read its tokens).

Independently, a request with a deadline is released when the deadline passes, whatever it is doing
(waiting for KV or generating).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.decode.config import DecodeConfig
from services.decode.reservations import EndCause, Reservation, lease_expiry

log = logging.getLogger(__name__)

Release = Callable[[Reservation, EndCause], Awaitable[None]]


class LeaseKeeper:
    def __init__(self, config: DecodeConfig, release: Release,
                 on_end: Callable[[Reservation, EndCause], None] | None = None) -> None:
        self.config = config
        self._release = release
        self._on_end = on_end
        self._tasks: set[asyncio.Task] = set()

    def expiry(self, requested_ms: int, deadline_unix: float, *, kv_started: bool = True) -> float:
        """Unix time a lease asked for now would end (see :func:`lease_expiry`); capped at --lease-ms
        until KV has started arriving, at --max-lease-ms after."""
        cap = self.config.max_lease_ms if kv_started else self.config.lease_ms
        return lease_expiry(time.time(), requested_ms, self.config.lease_ms, cap, deadline_unix)

    def arm(self, r: Reservation, requested_ms: int) -> None:
        """Start a new reservation's lease and, if it has a deadline, its deadline timer."""
        self.set_lease(r, requested_ms)
        if r.deadline_unix > 0:
            delay = max(0.0, r.deadline_unix - time.time())
            r.deadline_timer = asyncio.get_running_loop().call_later(delay, self._fire, r, EndCause.DEADLINE)

    def set_lease(self, r: Reservation, requested_ms: int) -> float:
        """(Re)start ``r``'s lease from now; returns when it ends (Unix seconds)."""
        if r.lease is not None:
            r.lease.cancel()
        r.lease_ms = requested_ms
        r.lease_expires_unix = self.expiry(requested_ms, r.deadline_unix, kv_started=r.kv_started)
        delay = max(0.0, r.lease_expires_unix - time.time())
        r.lease = asyncio.get_running_loop().call_later(delay, self._fire, r, EndCause.EXPIRED)
        return r.lease_expires_unix

    def landed(self, r: Reservation) -> None:
        """``r``'s KV landed: its lease now bounds the wait for a Generate stream, if none is open."""
        if r.streaming:
            self.picked_up(r)
        else:
            self.set_lease(r, r.lease_ms)

    @staticmethod
    def picked_up(r: Reservation) -> None:
        """A Generate stream is attached: once the KV is in, no lease is needed any more."""
        if r.complete and r.lease is not None:
            r.lease.cancel()
            r.lease = None

    def _fire(self, r: Reservation, cause: EndCause) -> None:
        if cause is EndCause.EXPIRED:
            r.lease = None
            if r.complete and r.streaming:
                return
        else:
            r.deadline_timer = None
        if r.end_cause is not None:
            return
        what = {EndCause.EXPIRED: "expired without a Generate stream" if r.complete else "expired without its KV"}
        log.warning("reservation %s (request %s) %s", r.reservation_id, r.request_id,
                    what.get(cause, "passed its deadline"))
        if self._on_end is not None:
            self._on_end(r, cause)
        task = asyncio.ensure_future(self._release(r, cause))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Wait for releases in flight (shutdown)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
