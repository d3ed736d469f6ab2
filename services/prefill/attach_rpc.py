"""The prefill servicer's side of an early Prefill (services/prefill/attach.py): the AttachReservation RPC
and the request's wait for it. Mixed into PrefillServicer (its config, direct writes, pages and layout)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from services.common.grpc_util import Reason, abort, error_detail
from services.common.pb import prefill_pb2
from services.common.tls import peer_role
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import KVPages
from services.engine.kv_transport.base import PageWriter
from services.kv.planner import DirectWrites, InvalidDestinationError
from services.prefill.attach import Attachments, AttachRefused, Waiting, ended, merged
from services.prefill.config import PrefillConfig
from services.prefill.engine_port import PrefillEngine
from services.prefill.kv_stream import AttachTimeout, RequestKVStream
from services.prefill.request_checks import ids_problem, layout_mismatch, reservation_problem

SIDE = "prefill"


class EarlyAttach:
    """AttachReservation and the early request's wait; the servicer provides these attributes."""

    attachments: Attachments
    config: PrefillConfig
    port: PrefillEngine
    direct: DirectWrites
    pages: KVPages
    layout: PageLayout
    _fp8_agreed: Callable[[prefill_pb2.PrefillRequest], PageLayout | None]
    _phase: Callable[[str, float], None]

    def _attach_before_compute(self, ids: list[int]) -> bool:
        """Whether an early request waits for its reservation before it is admitted: with mooncake layer-group
        export on (GPU), a prompt of one chunk leaves group by group only if its writer exists when that chunk's
        step starts (on the H200 at 2K: 1.21x colocated so, 1.45-1.50x when the step began before the attach);
        longer prompts take it long before their last chunk, and other transports gain nothing by waiting."""
        port = self.port
        return self.direct.modes.overlaps_compute and port.layer_group > 0 and len(ids) <= port.max_prefill_chunk

    async def _await_attach_first(self, waiting: Waiting, stream: RequestKVStream
                                  ) -> tuple[prefill_pb2.PrefillRequest, PageWriter | None]:
        """``_await_attach`` before admission (nothing computed yet, so the wait is bounded here): past
        ``claim_wait_s``, AttachTimeout (retryable, nothing computed or written)."""
        try:
            return await asyncio.wait_for(self._await_attach(waiting, stream), self.config.claim_wait_s)
        except TimeoutError:
            raise AttachTimeout(f"no AttachReservation within {self.config.claim_wait_s:g} s (--claim-wait-s) of the "
                                "Prefill call; nothing was computed or written", grpc.StatusCode.UNAVAILABLE) from None

    async def _await_attach(self, waiting: Waiting, stream: RequestKVStream
                            ) -> tuple[prefill_pb2.PrefillRequest, PageWriter | None]:
        """The early request with its reservation, and its writer (None: bytes in the stream). Offers whose
        destination does not fit are refused back to their attach call and the wait goes on; past
        ``claim_wait_s`` from the prompt being computed (refused offers do not extend it): AttachTimeout
        (retryable, nothing written). Every offer taken off the queue is answered, whatever ends the wait."""
        computed = asyncio.ensure_future(stream.computed.wait())
        get = asyncio.ensure_future(waiting.offers.get())
        try:
            while True:
                await asyncio.wait({get, computed}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    if stream.last_computed is None:  # the stream failed before its last chunk: its error
                        raise await stream.queue.get()  # type: ignore[misc]
                    left_s = stream.last_computed + self.config.claim_wait_s - time.monotonic()
                    await asyncio.wait({get}, timeout=max(0.0, left_s))
                    if not get.done():
                        raise AttachTimeout(f"no AttachReservation within {self.config.claim_wait_s:g} s "
                                            "(--claim-wait-s) of the prompt being computed; no page was written",
                                            grpc.StatusCode.UNAVAILABLE)
                offer = get.result()
                try:
                    writer = await self.direct.writer(offer.request, self.pages.pool, len(offer.request.dest_block_ids)
                                                      or -(-len(offer.request.token_ids) // self.layout.block_size),
                                                      self.pages.export, self._fp8_agreed(offer.request))
                except InvalidDestinationError as e:
                    offer.reply(AttachRefused("dest_block_ids", f"dest_block_ids: {e}"))
                    get = asyncio.ensure_future(waiting.offers.get())
                    continue
                offer.reply()
                self._phase("attached", time.monotonic() - stream.arrival)
                return offer.request, writer
        finally:
            computed.cancel()
            get.cancel()
            if get.done() and not get.cancelled():  # taken, and the request is ending (cancelled, deadline,
                get.result().reply(ended())  # failed): its attach call is answered (a no-op once it was)

    async def AttachReservation(self, request: prefill_pb2.AttachReservationRequest,
                                context: grpc.aio.ServicerContext) -> prefill_pb2.AttachReservationResponse:
        if self.config.tls_enabled and peer_role(context) != "router":
            await abort(context, grpc.StatusCode.PERMISSION_DENIED, "AttachReservation: only the router (client "
                        "certificate role 'router') may call it", error_detail(Reason.ERROR_REASON_PERMISSION,
                                                                               side=SIDE))
        bad = ids_problem(request, ("request_id", "attach_id"))
        if bad is not None:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"{bad[0]}: {bad[1]}",
                        error_detail(Reason.ERROR_REASON_INVALID_INPUT, side=SIDE, field=bad[0]))
        waiting = await self.attachments.find(request.attach_id)
        if waiting is None or waiting.request.request_id != request.request_id:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"no early Prefill of request {request.request_id!r} with attach_id {request.attach_id!r} "
                        "is waiting on this prefill", error_detail(Reason.ERROR_REASON_INVALID_INPUT, side=SIDE,
                                                                    field="attach_id"))
        full = merged(waiting.request, request)
        bad = reservation_problem(full, self.layout.block_size)
        mismatch = layout_mismatch(full, self.layout)
        try:
            if bad is not None:
                raise AttachRefused(bad[0], f"{bad[0]}: {bad[1]}")
            if mismatch is not None:
                raise AttachRefused("expected_layout_fingerprint", mismatch)
            await self.attachments.offer(waiting, full)
        except AttachRefused as e:
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, Reason.ERROR_REASON_INVALID_INPUT
            if e.field == "attach_id":
                code = grpc.StatusCode.FAILED_PRECONDITION
            elif e.field == "expected_layout_fingerprint":
                code, reason = grpc.StatusCode.FAILED_PRECONDITION, Reason.ERROR_REASON_LAYOUT_MISMATCH
            await abort(context, code, f"AttachReservation of {request.request_id}: {e}",
                        error_detail(reason, side=SIDE, field=e.field))
        return prefill_pb2.AttachReservationResponse()
