"""Decode servicer: Reserve, PushKV, Generate, Abort (thin; domain logic in reservations/kv_receiver)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.common import tracing
from services.common.convert import finish_to_pb, layout_to_pb, params_from_pb
from services.common.grpc_util import abort_if_draining
from services.common.metrics import DecodeMetrics
from services.common.pb import common_pb2, decode_pb2, decode_pb2_grpc
from services.decode.config import DecodeConfig
from services.decode.kv_receiver import DecodeKVReceiver, KVRejected
from services.decode.reservations import Reservation, ReservationTable
from services.engine.async_engine import AsyncEngine
from services.engine.block_manager import NoFreeBlocksError
from services.engine.engine import RequestOutput
from services.engine.sampling_params import InvalidRequestError

log = logging.getLogger(__name__)


def _response(rid: str, o: RequestOutput) -> common_pb2.GenerateResponse:
    msg = common_pb2.GenerateResponse(request_id=rid, token_ids=o.new_token_ids,
                                      finish_reason=finish_to_pb(o.finish_reason))
    if any(lp is not None for lp in o.new_logprobs):
        msg.logprobs.extend(lp or 0.0 for lp in o.new_logprobs)
    if o.finished:
        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=o.num_prompt_tokens, completion_tokens=o.num_output_tokens,
                                            cached_tokens=o.num_cached_tokens))
    return msg


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, config: DecodeConfig, metrics: DecodeMetrics, draining: asyncio.Event) -> None:
        self.config = config
        self.metrics = metrics
        self.draining = draining
        self.table = ReservationTable()
        self._bg: set[asyncio.Future] = set()
        self.engine: AsyncEngine = None  # type: ignore[assignment]  # bound once the model is loaded

    def bind(self, engine: AsyncEngine) -> None:
        """Attach the loaded engine (the server answers NOT_SERVING until then)."""
        metrics = self.metrics
        self.engine = engine
        self.model = engine.engine.loaded.model_id
        self.layout = engine.engine.layout
        self.receiver = DecodeKVReceiver(engine, self.layout, self.table, [engine.engine.fp8_layout],
                                         on_landed=self._landed,
                                         on_rejected=lambda reason: metrics.kv_chunks_rejected_total.labels(reason).inc())

    # --- Reserve ---

    async def _ready(self, context: grpc.aio.ServicerContext) -> None:
        await abort_if_draining(context, self.draining, "decode")
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode is still loading its model")

    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        await self._ready(context)
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        try:
            params = params_from_pb(request.params)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = self.table.new_id()
        try:
            q, num_cached, table = await self.engine.reserve(rid, list(request.token_ids), params,
                                                             detokenize=bool(params.stop))
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (NoFreeBlocksError, ValueError) as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"cannot reserve KV blocks: {e}")
        lease_s = (request.lease_ms or self.config.lease_ms) / 1000.0
        r = Reservation(rid, request.request_id, len(request.token_ids), params, table, num_cached, q,
                        lease_expires_unix=time.time() + lease_s)
        r.lease = asyncio.get_running_loop().call_later(lease_s, self._expire, r)
        self.table.add(r)
        shm = self.engine.engine.runner.kv_shm_descriptor
        info = {"fp8": self.engine.engine.fp8_layout.fingerprint}  # accepts fp8-e4m3 pages, decoded on arrival
        if shm:  # the pool prefills on this host may write into: a /dev/shm file or a CUDA IPC handle
            info["cuda-ipc" if self.engine.engine.runner.device.type == "cuda" else "shm"] = shm
        return decode_pb2.ReserveResponse(reservation_id=rid, num_cached_blocks=num_cached,
                                          block_size=self.layout.block_size, layout=layout_to_pb(self.layout),
                                          lease_expires_unix=r.lease_expires_unix, block_ids=table,
                                          transport_info=info)

    def _expire(self, r: Reservation) -> None:
        if r.complete or self.table.get(r.reservation_id) is None:
            return
        log.warning("reservation %s (request %s) expired without its KV", r.reservation_id, r.request_id)
        self.metrics.reservations_expired_total.labels(self.model).inc()
        r.lease = None
        task = asyncio.ensure_future(self.receiver.release(r))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    def _landed(self, r: Reservation, last: common_pb2.KVChunk) -> None:
        self.metrics.kv_wait_seconds.labels(self.model).observe(r.kv_done_at - r.reserved_at)
        if last.prefill_done_unix:
            self.metrics.kv_transfer_exposed_seconds.labels(self.model).observe(
                max(0.0, time.time() - last.prefill_done_unix))

    # --- PushKV ---

    async def PushKV(self, request_iterator: AsyncIterator[common_pb2.KVChunk],
                     context: grpc.aio.ServicerContext) -> decode_pb2.PushKVResponse:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode is still loading its model")
        transport = "grpc"

        async def counted() -> AsyncIterator[common_pb2.KVChunk]:
            nonlocal transport
            async for c in request_iterator:
                transport = c.transport or "grpc"
                yield c

        with tracing.span_from_metadata("decode.kv_push", context.invocation_metadata()):
            try:
                resp = await self.receiver.receive(counted())
            except KVRejected as e:
                await context.abort(e.code, str(e))
        self.metrics.kv_chunks_received_total.labels(transport).inc(resp.chunks_received)
        self.metrics.kv_received_bytes_total.labels(transport).inc(resp.bytes_received)
        return resp

    # --- Generate ---

    async def Generate(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        if not request.reservation_id:  # a new colocated request: refused while draining
            await self._ready(context)
            async for msg in self._colocated(request, context):
                yield msg
            return
        if self.engine is None:  # (an existing reservation is served while draining)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode is still loading its model")
        r = self.table.get(request.reservation_id)
        if r is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown reservation {request.reservation_id!r}")
        if r.streaming:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"reservation {r.reservation_id} is already being streamed")
        r.streaming = True
        with tracing.span_from_metadata("decode.generate", context.invocation_metadata(),
                                        request_id=r.request_id):
            try:
                async for msg in self._stream(r.reservation_id, r.request_id, r.stream, lambda: r.kv_done_at):
                    yield msg
            finally:
                self.table.remove(r)

    async def _stream(self, engine_rid: str, request_id: str, q: asyncio.Queue, kv_done_at
                      ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Output 1 carries prefill's token; output 2 is the first decode step (decode queue = KV
        complete -> that step's token); later gaps are TPOT."""
        last: float | None = None
        index = 0
        async for o in self.engine.stream(engine_rid, q):
            now = time.monotonic()
            if o.new_token_ids:
                index += 1
                if index == 2 and kv_done_at() is not None:
                    self.metrics.queue_seconds.labels(self.model).observe(max(0.0, now - kv_done_at()))
                elif index > 2 and last is not None:
                    self.metrics.tpot_seconds.labels(self.model).observe(now - last)
                if index > 1:
                    self.metrics.generation_tokens_total.labels(self.model).inc(len(o.new_token_ids))
                last = now
            yield _response(request_id, o)

    async def _colocated(self, request: decode_pb2.DecodeGenerateRequest, context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """Colocated mode: this process runs prefill and decode for the prompt (the A/B baseline)."""
        if self.config.mode != "colocated":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "reservation_id: required (this decode runs disaggregated; start it with "
                                "--mode colocated to take prompts)")
        try:
            params = params_from_pb(request.params)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or self.table.new_id()
        q = self.engine.open_stream(rid)
        try:
            await self.engine.call(self.engine.engine.add_request, rid, list(request.token_ids), params,
                                   bool(params.stop))
        except InvalidRequestError as e:
            self.engine.close_stream(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ValueError as e:
            self.engine.close_stream(rid)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        with tracing.span_from_metadata("decode.generate", context.invocation_metadata(), request_id=rid):
            async for o in self.engine.stream(rid, q):
                yield _response(rid, o)

    # --- Abort ---

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        if self.engine is None:
            return common_pb2.AbortResponse(found=False)
        r = self.table.find(request.request_id)
        if r is not None:
            await self.receiver.release(r)
            return common_pb2.AbortResponse(found=True)
        found = await self.engine.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)

    async def drain(self) -> None:
        """Wait for in-flight KV transfers to land (the server bounds the wait)."""
        while any(r.receiving for r in self.table.values()):  # noqa: ASYNC110 (bounded by the server's drain timeout)
            await asyncio.sleep(0.05)
