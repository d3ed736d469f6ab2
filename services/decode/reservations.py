"""Reservations: destination blocks held for a request whose KV a prefill is sending.

A reservation lives from Reserve until its last KV chunk lands (then the request runs) or until
its lease runs out, whichever is first; an expired reservation's blocks are freed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from services.engine.sampling_params import SamplingParams


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
    reserved_at: float = field(default_factory=time.monotonic)
    lease_expires_unix: float = 0.0
    lease: asyncio.TimerHandle | None = None
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
        if r.lease is not None:
            r.lease.cancel()
            r.lease = None
        self._by_id.pop(r.reservation_id, None)
        if self._by_request.get(r.request_id) == r.reservation_id:
            del self._by_request[r.request_id]

    def __len__(self) -> int:
        return len(self._by_id)

    def values(self) -> list[Reservation]:
        return list(self._by_id.values())
