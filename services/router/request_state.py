"""Dispatch settings (frozen, shared by every request) and what one request carries through dispatch."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from services.common.pb import common_pb2, decode_pb2, prefill_pb2
from services.router.config import RouterConfig
from services.router.instances import Instance
from services.router.pipeline import BackendError
from services.router.rpc_failure import RpcFailure

CONTROL_TIMEOUT_S = 30.0
"""Longest Reserve / RenewLease / Abort may take (seconds): they answer from published state, so an
instance that needs longer is hung. Also bounded by the request's deadline."""


@contextlib.asynccontextmanager
async def token_stream(inst: Instance, request: decode_pb2.DecodeGenerateRequest, settings: DispatchSettings, *,
                       metadata: tuple[tuple[str, str], ...], timeout_s: float
                       ) -> AsyncIterator[AsyncIterator[common_pb2.GenerateResponse]]:
    """One request's tokens from ``inst`` as --decode-stream says: over the instance's token stream ("step")
    or a Decode.Generate call of its own ("per-request"); the same messages and errors either way. Leaving
    the block before the last message cancels the request there at once."""
    if settings.decode_stream == "step":
        async with contextlib.aclosing(inst.streams.generate(request, metadata=metadata, timeout_s=timeout_s)) as g:
            yield g
        return
    call = inst.decode.Generate(request, metadata=metadata, timeout=timeout_s)
    try:
        yield call
    finally:
        call.cancel()  # a no-op once the call ended


def _router_default(name: str) -> Any:
    """RouterConfig's default of ``name``: each dispatch setting is declared (help, default, flag,
    env var) once, there."""
    return next(f.default for f in dataclasses.fields(RouterConfig) if f.name == name)


@dataclass(frozen=True)
class DispatchSettings:
    """The router's dispatch knobs: a frozen copy of RouterConfig's fields (see their help there),
    shared by every request and never written after start."""

    policy: str = _router_default("policy")
    prefix_credit: float = _router_default("prefix_credit")
    lease_ms: int = _router_default("lease_ms")
    max_retries: int = _router_default("max_retries")
    chunked_transfer: bool | None = _router_default("chunked_transfer")
    early_prefill: bool = _router_default("early_prefill")
    block_size: int = 16
    """Tokens per block of the routing hashes (the prefix index); a decode's own block size comes
    with its Reserve answer and is used for that request only."""
    timeout_s: float = _router_default("request_timeout_s")
    """Deadline of a request whose client named none (seconds from arrival): --request-timeout-s."""
    restart_wait_s: float = _router_default("restart_wait_s")
    block_wait_s: float = _router_default("block_wait_s")
    decode_stream: str = _router_default("decode_stream")

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> DispatchSettings:
        return cls(policy=cfg.policy, prefix_credit=cfg.prefix_credit, lease_ms=cfg.lease_ms,
                   max_retries=cfg.max_retries, chunked_transfer=cfg.chunked_transfer,
                   early_prefill=cfg.early_prefill, timeout_s=cfg.request_timeout_s,
                   restart_wait_s=cfg.restart_wait_s, block_wait_s=cfg.block_wait_s,
                   decode_stream=cfg.decode_stream)


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
    arrived: float = field(default_factory=time.monotonic)
    """When dispatch took the request (monotonic seconds): the origin of the router's handoff phases."""
    phases: set[str] = field(default_factory=set)
    """Handoff phases already observed for this request: each once, at its first attempt that reached it
    (a retry or migration runs another attempt; ``first_token`` is so the client's first token)."""

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
