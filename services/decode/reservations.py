"""Reservations: destination blocks held for a request whose KV a prefill is sending.

A reservation lives from Reserve until its request finishes, or until it ends early: its lease runs
out before the KV lands (or, once it landed, before a Generate stream picks the request up), the
request's deadline passes, its KV stream breaks the protocol, or it is aborted. An ended reservation leaves the table at once; its blocks are freed as soon as no page write
into them is in flight (see DecodeKVReceiver.release).

Only the holder of the reservation's token (issued by Reserve, 16 random bytes) may write KV into it
or renew its lease; a wrong token changes nothing.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import secrets
import time
import uuid
from dataclasses import dataclass, field

from services.text.sampling_params import SamplingParams

TOKEN_BYTES = 16


class EndCause(enum.Enum):
    """Why a reservation ended before its request finished."""

    EXPIRED = "expired"      # the lease ran out before the KV landed
    DEADLINE = "deadline"    # the request's deadline_unix passed
    REJECTED = "rejected"    # its KV stream broke the protocol: the pages cannot be trusted
    ABORTED = "aborted"      # Abort RPC, or its Generate consumer went away


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def lease_expiry(now_unix: float, requested_ms: int, default_ms: int, max_ms: int, deadline_unix: float) -> float:
    """When a lease asked for at ``now_unix`` ends (Unix seconds): ``requested_ms`` (0: ``default_ms``)
    capped at ``max_ms``, and never past ``deadline_unix`` when that is non-zero."""
    ms = min(requested_ms or default_ms, max_ms)
    expiry = now_unix + ms / 1000.0
    return min(expiry, deadline_unix) if deadline_unix > 0 else expiry


@dataclass(eq=False)
class Reservation:
    reservation_id: str
    request_id: str
    prompt_len: int
    params: SamplingParams
    block_ids: list[int]
    """The request's block table on this decode (prompt blocks)."""
    num_cached_blocks: int
    """Leading blocks already valid here (prefix cache); the sender skips them."""
    stream: asyncio.Queue
    token: bytes = field(default_factory=new_token, repr=False)
    caller: str = ""
    """Who reserved it (services.common.tls.peer_identity): the per-caller share is counted on it."""
    deadline_unix: float = 0.0
    """The request's deadline (Unix seconds); 0: none."""
    reserved_at: float = field(default_factory=time.monotonic)
    lease_ms: int = 0
    """The lease the caller asked for (ms; 0: the server default), before the caps."""
    lease_expires_unix: float = 0.0
    lease: asyncio.TimerHandle | None = None
    deadline_timer: asyncio.TimerHandle | None = None
    end_cause: EndCause | None = None
    """Set once when the reservation ends early; it has then left the table."""
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    """Set with end_cause: wakes a KV stream waiting for its next chunk."""
    # KV arrival bookkeeping (one PushKV stream at a time; a new stream restarts at chunk 0).
    next_chunk: int = 0
    pages_written: set[int] = field(default_factory=set)
    kv_done_at: float | None = None
    receiving: bool = False
    streaming: bool = False
    bytes_received: int = 0

    @property
    def complete(self) -> bool:
        return self.kv_done_at is not None

    @property
    def kv_started(self) -> bool:
        """Some of its KV arrived (a chunk accepted, or all of it landed)."""
        return self.next_chunk > 0 or self.complete

    def token_ok(self, token: bytes) -> bool:
        """Constant-time comparison with the token Reserve issued."""
        return hmac.compare_digest(token, self.token)

    def reset_transfer(self) -> None:
        """Forget a broken stream's progress: the next stream (a retried prefill) starts at chunk 0."""
        self.next_chunk = 0
        self.pages_written.clear()
        self.bytes_received = 0


class ReservationTable:
    def __init__(self) -> None:
        self._by_id: dict[str, Reservation] = {}
        self._by_request: dict[str, str] = {}

    @staticmethod
    def new_id() -> str:
        return "rsv-" + uuid.uuid4().hex

    def add(self, r: Reservation) -> None:
        self._by_id[r.reservation_id] = r
        self._by_request[r.request_id] = r.reservation_id

    def get(self, reservation_id: str) -> Reservation | None:
        return self._by_id.get(reservation_id)

    def find(self, key: str) -> Reservation | None:
        """By reservation id or by the router's request id."""
        r = self._by_id.get(key)
        if r is None and key in self._by_request:
            r = self._by_id.get(self._by_request[key])
        return r

    def remove(self, r: Reservation) -> None:
        for timer in (r.lease, r.deadline_timer):
            if timer is not None:
                timer.cancel()
        r.lease = r.deadline_timer = None
        self._by_id.pop(r.reservation_id, None)
        if self._by_request.get(r.request_id) == r.reservation_id:
            del self._by_request[r.request_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def values(self) -> list[Reservation]:
        return list(self._by_id.values())

    def num_awaiting_kv(self) -> int:
        """Reservations whose KV has not fully landed yet (count)."""
        return sum(1 for r in self._by_id.values() if not r.complete)

    def blocks_awaiting_kv(self) -> dict[str, int]:
        """caller -> blocks its reservations hold while their KV has not fully landed."""
        out: dict[str, int] = {}
        for r in self._by_id.values():
            if not r.complete:
                out[r.caller] = out.get(r.caller, 0) + len(r.block_ids)
        return out


def caller_share(total_blocks: int, holders: dict[str, int], caller: str) -> int:
    """Blocks ``caller``'s reservations awaiting KV may hold together: the whole pool while it is the only
    caller holding such blocks, else ``total_blocks // n`` with n the callers holding them (``caller``
    counted). So one caller cannot hold more than an equal share while others wait for their KV, and a
    lone router is not held back (its own reservations waiting for a busy prefill may fill the pool)."""
    n = len(holders) + (caller not in holders)
    return total_blocks if n == 1 else total_blocks // n
