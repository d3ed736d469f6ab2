"""Early Prefill: the reservation of a request the router sent before decode's Reserve answered.

The router sends Prefill with ``attach_id`` set and no reservation, then AttachReservation with the
reservation once decode answered. The request admits and computes at once; its writer set-up, wire codec,
``num_skip_blocks`` and claim wait for the attach (nothing is written before decode acknowledged the
claim: kv_stream defers every computed page until then).

One attach per waiting request, handed over through :class:`Waiting`: the handler merges it into the
request (:func:`merged`), checks it as a full PrefillRequest is checked, and offers it to the request's
task, which builds the writer (a bad destination is refused there) and answers. A refused attach changes
nothing: the request keeps waiting for a good one. An accepted one is final: any later attach is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from services.common.pb import prefill_pb2

UNKNOWN_WAIT_S = 1.0
"""Longest an attach for an attach_id this prefill does not hold waits for its Prefill call to arrive
(seconds): the two calls travel separately, so the attach may overtake its Prefill by a little."""

RESERVATION_FIELDS = ("decode_address", "reservation_id", "num_skip_blocks", "expected_layout_fingerprint",
                      "dest_block_ids", "reservation_token", "destination", "accepted_wire_fingerprints")
"""PrefillRequest fields that come from decode's Reserve: empty in an early Prefill, set by the attach."""


class AttachRefused(Exception):
    """An attach the request did not take: ``field`` names the attach field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass
class Offer:
    request: prefill_pb2.PrefillRequest
    """The early request with the attach's reservation fields."""
    answer: asyncio.Future[None]
    """Resolved by the request's task: None (taken) or AttachRefused."""

    def reply(self, refused: AttachRefused | None = None) -> None:
        """Answer the attach call (a no-op once it is gone: cancelled by its caller)."""
        if self.answer.done():
            return
        if refused is None:
            self.answer.set_result(None)
        else:
            self.answer.set_exception(refused)


@dataclass
class Waiting:
    """One early request waiting for its reservation."""

    request: prefill_pb2.PrefillRequest
    offers: asyncio.Queue[Offer] = field(default_factory=asyncio.Queue)
    busy: bool = False
    """An attach is being checked by the request's task (a second one meanwhile is refused)."""
    attached: bool = False


class Attachments:
    """Early requests of this prefill by attach_id (event-loop only)."""

    def __init__(self) -> None:
        self.waiting: dict[str, Waiting] = {}
        self._arrivals: dict[str, asyncio.Event] = {}

    def register(self, request: prefill_pb2.PrefillRequest) -> Waiting | None:
        """The request's entry, or None when another call already uses its attach_id."""
        if request.attach_id in self.waiting:
            return None
        w = self.waiting[request.attach_id] = Waiting(request)
        arrived = self._arrivals.pop(request.attach_id, None)
        if arrived is not None:
            arrived.set()
        return w

    def remove(self, waiting: Waiting) -> None:
        """The request ended: an attach still being offered is refused, later ones find nothing."""
        if self.waiting.get(waiting.request.attach_id) is waiting:
            del self.waiting[waiting.request.attach_id]
        while not waiting.offers.empty():
            waiting.offers.get_nowait().reply(ended())

    async def find(self, attach_id: str, wait_s: float = UNKNOWN_WAIT_S) -> Waiting | None:
        """The waiting request of ``attach_id``, waiting up to ``wait_s`` for its Prefill call to arrive."""
        w = self.waiting.get(attach_id)
        if w is not None:
            return w
        arrived = self._arrivals.setdefault(attach_id, asyncio.Event())
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), wait_s)
        finally:
            if self._arrivals.get(attach_id) is arrived:
                del self._arrivals[attach_id]
        return self.waiting.get(attach_id)

    async def offer(self, waiting: Waiting, request: prefill_pb2.PrefillRequest) -> None:
        """Hand ``request`` (early request + reservation) to its task; raises AttachRefused."""
        if waiting.attached:
            raise AttachRefused("attach_id", "this request already has its reservation (an attach is accepted "
                                             "once)")
        if waiting.busy:
            raise AttachRefused("attach_id", "another attach of this request is being checked")
        waiting.busy = True
        try:
            answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            await waiting.offers.put(Offer(request, answer))
            await answer
            waiting.attached = True
        finally:
            waiting.busy = False


def ended() -> AttachRefused:
    """The refusal of an attach whose Prefill call ended before taking it."""
    return AttachRefused("attach_id", "the Prefill call ended before it took the reservation")


def merged(early: prefill_pb2.PrefillRequest, att: prefill_pb2.AttachReservationRequest
           ) -> prefill_pb2.PrefillRequest:
    """``early`` with the reservation fields of ``att`` (a full PrefillRequest, attach_id kept)."""
    req = prefill_pb2.PrefillRequest()
    req.CopyFrom(early)
    req.decode_address = att.decode_address
    req.reservation_id = att.reservation_id
    req.num_skip_blocks = att.num_skip_blocks
    req.expected_layout_fingerprint = att.expected_layout_fingerprint
    req.dest_block_ids.extend(att.dest_block_ids)
    req.reservation_token = att.reservation_token
    if att.HasField("destination"):
        req.destination.CopyFrom(att.destination)
    req.accepted_wire_fingerprints.extend(att.accepted_wire_fingerprints)
    return req


def early_problem(request: prefill_pb2.PrefillRequest) -> tuple[str, str] | None:
    """An early Prefill carries no reservation field (they come with the attach)."""
    for name in RESERVATION_FIELDS:
        value = getattr(request, name)
        present = request.HasField(name) if name == "destination" else bool(value)
        if present:
            return name, "must be empty in an early Prefill (attach_id set): it comes with AttachReservation"
    return None
