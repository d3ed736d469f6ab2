"""How a prefill request ended, read off its stream and claim: the handoff failure's typed detail, decode's
refusal of a claim, and the request's queue / compute times."""

from __future__ import annotations

import asyncio
import time

from services.common.grpc_util import Reason, error_detail
from services.common.pb import common_pb2
from services.engine.kv_transport import TransferError
from services.engine.kv_transport.base import ClaimUnanswered
from services.prefill.kv_stream import ClaimTimeout, RequestKVStream


def handoff_detail(e: TransferError) -> common_pb2.ErrorDetail:
    """A claim decode did not answer in time is retryable with the same reservation (decode kept it, no page
    was written; the sender's ClaimTimeout or a layer-group write's ClaimUnanswered): not KV_HANDOFF_FAILED,
    which the router ends the request on."""
    if isinstance(e, (ClaimTimeout, ClaimUnanswered)):
        return error_detail(Reason.ERROR_REASON_UNSPECIFIED, retryable=True, side="decode")
    return error_detail(Reason.ERROR_REASON_KV_HANDOFF_FAILED, retryable=False, side="decode")


def refusal(claim: asyncio.Future[None] | None) -> TransferError | None:
    """Decode's refusal of a writer's claim, once the claim has ended with one."""
    if claim is None or not claim.done() or claim.cancelled():
        return None
    e = claim.exception()
    return e if isinstance(e, TransferError) else None


def stream_times(stream: RequestKVStream) -> tuple[float, float]:
    """(queue, compute) seconds of a finished request: arrival -> first chunk scheduled -> last computed."""
    first = stream.first_scheduled or stream.arrival
    queue_s = first - stream.arrival
    compute_s = (stream.last_computed or time.monotonic()) - first
    return max(0.0, queue_s), max(0.0, compute_s)

