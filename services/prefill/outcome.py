"""One prefill request's handoff, and how it ended, read off its stream and claim: the handoff failure's
typed detail, decode's refusal of a claim, and the request's queue / compute times."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from services.common.grpc_util import Reason, error_detail
from services.common.pb import common_pb2, prefill_pb2
from services.engine.kv_layout import PageLayout
from services.engine.kv_transport import KVSender, TransferError
from services.engine.kv_transport.base import ClaimUnanswered, PageWriter
from services.prefill.attach import Waiting
from services.prefill.kv_stream import ClaimTimeout, RequestKVStream


@dataclass
class Handoff:
    """One Prefill call's handoff to decode, as it stands: an early request's fields change once its reservation
    is attached (the merged request, its writer, wire codec, sender and claim)."""

    request: prefill_pb2.PrefillRequest
    rid: str
    """The engine request id."""
    stream: RequestKVStream
    writer: PageWriter | None
    """The connector's writer into decode's pool (None: page bytes in the stream)."""
    wire: PageLayout
    """The layout of the pages on the wire."""
    transport: str
    """The transport's name (metric label)."""
    waiting: Waiting | None = None
    """An early request's wait for AttachReservation (None: the reservation came with the call)."""
    sender: KVSender | None = None
    claim: asyncio.Future[None] | None = None
    attach: asyncio.Future[tuple[prefill_pb2.PrefillRequest, PageWriter | None]] | None = None
    """An early request's attach, awaited while admission runs."""


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

