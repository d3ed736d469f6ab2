"""Dispatch settings (frozen, shared by every request) and what one request carries through dispatch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.pb import common_pb2, prefill_pb2
from services.router.instances import Instance
from services.router.pipeline import BackendError
from services.router.policy import DEFAULT_PREFIX_CREDIT
from services.router.rpc_failure import RpcFailure

CONTROL_TIMEOUT_S = 30.0
"""Longest Reserve / RenewLease / Abort may take (seconds): they answer from published state, so an
instance that needs longer is hung. Also bounded by the request's deadline."""


@dataclass(frozen=True)
class DispatchSettings:
    """The router's dispatch knobs (from RouterConfig); immutable, shared by all requests."""

    policy: str = "prefix_aware"
    prefix_credit: float = DEFAULT_PREFIX_CREDIT
    lease_ms: int = 30_000
    """Longest decode lease asked for (ms); never past the request's deadline; renewed every lease/3
    while the request's prefill is in flight."""
    max_retries: int = 2
    """Other instances tried per phase (reserve, prefill); also the most migrations per request."""
    chunked_transfer: bool | None = None
    block_size: int = 16
    """Tokens per block of the routing hashes (the prefix index); a decode's own block size comes
    with its Reserve answer and is used for that request only."""
    timeout_s: float = 600.0
    """Deadline of a request whose client named none (seconds from arrival)."""


@dataclass(eq=False)
class RequestState:
    """One client request as dispatch carries it (lives with the request, never in settings)."""

    request_id: str
    deadline_unix: float
    metadata: tuple[tuple[str, str], ...] = ()
    """Tracing metadata for every call made for this request."""
    target: tuple[Instance, str] | None = None
    """Where an Abort for this request goes now: (decode or worker, reservation or request id)."""
    lost: set[str] = field(default_factory=set)
    """Decode addresses that died under this request (never tried again for it)."""
    migrations: int = 0

    def remaining_s(self) -> float:
        return self.deadline_unix - time.time()

    def timeout_s(self, cap: float | None = None) -> float:
        """gRPC timeout for a call now: what is left before the deadline (capped); raises
        BackendError(deadline_exceeded) when nothing is."""
        left = self.remaining_s()
        if left <= 0:
            raise BackendError("deadline_exceeded", f"request {self.request_id}: its deadline passed")
        return left if cap is None else min(left, cap)

    def lease_ms(self, settings: DispatchSettings) -> int:
        return max(1, min(settings.lease_ms, int(self.remaining_s() * 1000)))


class DecodeLostError(Exception):
    """The decode (or colocated worker) serving a request died or is going away: migrate."""

    def __init__(self, address: str, why: str) -> None:
        super().__init__(f"{address}: {why}")
        self.address = address
        self.why = why


# --- events of one P/D attempt (queue between its tasks and the merge loop) ---

@dataclass(frozen=True)
class PrefillDone:
    resp: prefill_pb2.PrefillResponse


@dataclass(frozen=True)
class DecodeTokens:
    start: int
    """Output position (this attempt's) of msg.token_ids[0]."""
    msg: common_pb2.GenerateResponse


@dataclass(frozen=True)
class DecodeLost:
    failure: RpcFailure


@dataclass(frozen=True)
class HandoffFailed:
    """Prefill could not hand the KV to decode: decode's side failed (dead decode, or its reservation
    is gone)."""

    failure: RpcFailure


@dataclass(frozen=True)
class Failed:
    error: BackendError
    side: str
    """"prefill" or "decode"."""


DispatchEvent = PrefillDone | DecodeTokens | DecodeLost | HandoffFailed | Failed
