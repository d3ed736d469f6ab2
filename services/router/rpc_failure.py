"""What a failed call to a prefill or decode means for dispatch, read from its typed ErrorDetail.

Decisions read the status code and :func:`grpc_util.detail_of` (reason, retryable, retry-after),
never the message text.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.common.grpc_util import ERROR_DETAIL_KEY, Reason, detail_of
from services.common.pb import common_pb2
from services.router.instances import Instance, InstancePool
from services.router.pipeline import BackendError

DEFAULT_RETRY_AFTER_S = 1.0
"""How long an instance that answered OVERLOADED without a retry-after counts as full (seconds)."""

# A peer's status -> the client's. A peer's NOT_FOUND / ABORTED name an internal object (a reservation,
# a KV stream), never what the client asked for: the client gets "unavailable" (503, retry after), not 404.
_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid_argument",
    grpc.StatusCode.OUT_OF_RANGE: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "unavailable",
    grpc.StatusCode.ABORTED: "unavailable",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "deadline_exceeded",
}

# Reasons after which the instance takes no new work (it is going down or not up yet).
_GOING_AWAY = (Reason.ERROR_REASON_DRAINING, Reason.ERROR_REASON_ENGINE_DEAD, Reason.ERROR_REASON_LOADING)


@dataclass(frozen=True)
class RpcFailure:
    where: str
    """e.g. "decode 127.0.0.1:5 Reserve"."""
    code: grpc.StatusCode
    detail: common_pb2.ErrorDetail
    has_detail: bool
    """False when the peer attached no ErrorDetail (it died, or was never reached)."""
    message: str

    @classmethod
    def of(cls, where: str, err: grpc.aio.AioRpcError) -> RpcFailure:
        has = any(k == ERROR_DETAIL_KEY for k, _ in (err.trailing_metadata() or ()))
        return cls(where, err.code(), detail_of(err), has, err.details() or "")

    @property
    def reason(self) -> int:
        return int(self.detail.reason)

    @property
    def label(self) -> str:
        """Short snake_case cause for metrics (dispatch_retries_total's reason)."""
        if self.unreachable:
            return "unavailable"
        return Reason.Name(self.detail.reason).removeprefix("ERROR_REASON_").lower()

    @property
    def unreachable(self) -> bool:
        """No answer from a peer: it died mid-call or could not be reached."""
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) and not self.has_detail

    @property
    def overloaded(self) -> bool:
        return self.reason == Reason.ERROR_REASON_OVERLOADED

    @property
    def going_away(self) -> bool:
        return self.reason in _GOING_AWAY

    @property
    def retryable(self) -> bool:
        """Another instance may serve the same request."""
        return self.unreachable or bool(self.detail.retryable)

    @property
    def instance_lost(self) -> bool:
        """The instance is gone or going (its streams will not finish there): migrate."""
        return self.unreachable or self.reason in (Reason.ERROR_REASON_ENGINE_DEAD, Reason.ERROR_REASON_DRAINING)

    @property
    def handoff_failed(self) -> bool:
        return self.reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED

    @property
    def retry_after_s(self) -> float:
        return self.detail.retry_after_ms / 1000.0 if self.detail.retry_after_ms else DEFAULT_RETRY_AFTER_S

    def note(self, pool: InstancePool, inst: Instance) -> None:
        """Tell the pool what this failure says about the instance."""
        if self.overloaded:
            pool.report_overloaded(inst, self.retry_after_s)
        elif self.going_away:
            pool.report_gone(inst, f"{self.where}: {self.label}")
        elif self.unreachable:
            pool.report_unreachable(inst, f"{self.where}: {self.code.name} {self.message}")

    def error(self) -> BackendError:
        """The error the client gets when nothing else is left to try."""
        if self.overloaded:
            return BackendError("resource_exhausted", f"{self.where}: {self.message}",
                                retry_after_s=self.retry_after_s)
        if self.unreachable:
            code = "unavailable"
        elif self.reason == Reason.ERROR_REASON_DEADLINE:
            code = "deadline_exceeded"
        elif self.detail.retryable and self.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            code = "unavailable"  # whatever the peer's status: the same request may succeed again
        else:
            code = _CODES.get(self.code, "internal")
        retry = self.retry_after_s if code in ("unavailable", "deadline_exceeded") else None
        return BackendError(code, f"{self.where}: {self.code.name}: {self.message}",
                            param=(self.detail.field or None) if code == "invalid_argument" else None,
                            retry_after_s=retry)
