"""How decode fails an RPC: a gRPC status, a message saying what and why, and a typed ErrorDetail
(side "decode") that callers decide on."""

from __future__ import annotations

from typing import NoReturn

import grpc

from services.common.grpc_util import Reason, abort, error_detail
from services.common.pb import common_pb2
from services.decode.reservations import EndCause

SIDE = "decode"

# How a stream attached to a reservation ends when the reservation ended early:
# cause -> (status, reason, retryable on another instance).
END_STATUS: dict[EndCause, tuple[grpc.StatusCode, int, bool]] = {
    EndCause.EXPIRED: (grpc.StatusCode.NOT_FOUND, Reason.ERROR_REASON_RESERVATION_GONE, True),
    EndCause.DEADLINE: (grpc.StatusCode.DEADLINE_EXCEEDED, Reason.ERROR_REASON_DEADLINE, False),
    EndCause.REJECTED: (grpc.StatusCode.ABORTED, Reason.ERROR_REASON_KV_HANDOFF_FAILED, True),
    EndCause.ABORTED: (grpc.StatusCode.CANCELLED, Reason.ERROR_REASON_CANCELLED, False),
}

END_MESSAGE = {
    EndCause.EXPIRED: "its lease ran out before its KV landed",
    EndCause.DEADLINE: "the request's deadline passed",
    EndCause.REJECTED: "its KV stream was refused (see the prefill's error)",
    EndCause.ABORTED: "it was aborted",
}


async def fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, reason: int, *,
               retryable: bool = False, field: str = "", retry_after_ms: int = 0) -> NoReturn:
    await abort(context, code, message, error_detail(reason, retryable=retryable, side=SIDE, field=field,
                                                     retry_after_ms=retry_after_ms))


async def invalid(context: grpc.aio.ServicerContext, field: str, message: str) -> NoReturn:
    """INVALID_ARGUMENT naming ``field`` (``message`` should start with it)."""
    await fail(context, grpc.StatusCode.INVALID_ARGUMENT, message, Reason.ERROR_REASON_INVALID_INPUT, field=field)


async def gone(context: grpc.aio.ServicerContext, reservation_id: str, why: str = "expired, aborted or never made"
               ) -> NoReturn:
    await fail(context, grpc.StatusCode.NOT_FOUND, f"unknown reservation {reservation_id!r} ({why})",
               Reason.ERROR_REASON_RESERVATION_GONE, retryable=True)


def ended_status(reservation_id: str, cause: EndCause) -> tuple[grpc.StatusCode, str, common_pb2.ErrorDetail]:
    """The status, message and detail a stream of a reservation that ended early ends with."""
    code, reason, retryable = END_STATUS[cause]
    return (code, f"reservation {reservation_id} ended: {END_MESSAGE[cause]}",
            error_detail(reason, retryable=retryable, side=SIDE))


async def ended(context: grpc.aio.ServicerContext, reservation_id: str, cause: EndCause) -> NoReturn:
    code, message, detail = ended_status(reservation_id, cause)
    await abort(context, code, message, detail)


async def engine_dead(context: grpc.aio.ServicerContext, err: BaseException) -> NoReturn:
    await fail(context, grpc.StatusCode.UNAVAILABLE, f"decode's engine loop died ({err}); this instance is going "
               "down", Reason.ERROR_REASON_ENGINE_DEAD, retryable=True)


async def loading(context: grpc.aio.ServicerContext) -> NoReturn:
    await fail(context, grpc.StatusCode.UNAVAILABLE, "decode is still loading its model",
               Reason.ERROR_REASON_LOADING, retryable=True)
