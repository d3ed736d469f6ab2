"""The router's dispatch core: parallel dispatch of one request to a decode and a prefill.

1. Reserve on decode (it allocates destination blocks, reports which prefix blocks it holds).
2. Open decode's token stream for that reservation, and at the same time
3. send Prefill with that destination; prefill streams the KV to decode chunk by chunk.
4. The first token arrives with PrefillResponse (or first on decode's stream, whichever is first);
   later tokens come from decode. Tokens are merged by position, so none is sent twice.

Colocated mode (no prefill instances): decode gets the prompt and does both phases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from services.common import tracing
from services.common.convert import FINISH_NAMES, finish_from_pb, params_to_pb
from services.common.grpc_util import KV_HANDOFF_FAILED
from services.common.metrics import RouterMetrics
from services.common.pb import common_pb2, decode_pb2, prefill_pb2
from services.engine.block_hash import block_hashes
from services.engine.sampling_params import SamplingParams
from services.router.instances import Instance, InstancePool, inflight
from services.router.pipeline import BackendError, TokenEvent
from services.router.policy import NoInstanceError, choose

log = logging.getLogger(__name__)

_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "invalid_argument",
    grpc.StatusCode.FAILED_PRECONDITION: "invalid_argument",
    grpc.StatusCode.OUT_OF_RANGE: "invalid_argument",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "resource_exhausted",
    grpc.StatusCode.UNAVAILABLE: "unavailable",
    grpc.StatusCode.DEADLINE_EXCEEDED: "unavailable",
}


def _backend_error(where: str, e: grpc.aio.AioRpcError) -> BackendError:
    return BackendError(_CODES.get(e.code(), "internal"), f"{where}: {e.details()}")


@dataclass
class DispatchSettings:
    policy: str = "prefix_aware"
    lease_ms: int = 30_000
    max_retries: int = 2
    chunked_transfer: bool | None = None
    block_size: int = 16
    timeout_s: float = 600.0


class DisaggregatedBackend:
    def __init__(self, prefill: InstancePool | None, decode: InstancePool, settings: DispatchSettings,
                 metrics: RouterMetrics, model: str) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.s = settings
        self.metrics = metrics
        self.model = model
        self.active: dict[str, tuple[Instance, str]] = {}
        """request id -> (decode instance, reservation or request id there), for Abort."""

    def model_name(self) -> str:
        return self.model

    async def abort(self, request_id: str) -> None:
        entry = self.active.pop(request_id, None)
        if entry is None:
            return
        inst, key = entry
        with contextlib.suppress(grpc.aio.AioRpcError):
            await inst.decode.Abort(common_pb2.AbortRequest(request_id=key, reason="client"), timeout=5.0)

    def _pick(self, pool: InstancePool, hashes: list[bytes], exclude: set[str]) -> Instance:
        try:
            return choose(pool, self.s.policy, hashes, exclude)
        except NoInstanceError as e:
            raise BackendError("unavailable", str(e)) from e

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenEvent]:
        hashes = block_hashes(prompt_ids, self.s.block_size)
        md = tuple(tracing.inject_metadata())
        if self.prefill_pool is None:
            async for ev in self._colocated(request_id, prompt_ids, params, hashes, md):
                yield ev
            return
        decode, resv = await self._reserve(request_id, prompt_ids, params, hashes, md)
        self.active[request_id] = (decode, resv.reservation_id)
        events: asyncio.Queue = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._decode_stream(decode, resv.reservation_id, md, events)),
            asyncio.create_task(self._prefill(request_id, prompt_ids, params, hashes, decode, resv, md, events)),
        ]
        finished = False
        try:
            with inflight(decode):
                emitted = 0
                cached = 0
                while True:
                    kind, payload = await events.get()
                    if kind == "error":
                        raise payload
                    if kind == "prefill":
                        cached = payload.num_cached_tokens + resv.num_cached_blocks * resv.block_size
                        if emitted == 0:
                            emitted = 1
                            yield TokenEvent([payload.first_token],
                                             [payload.first_logprob if params.logprobs else None],
                                             prompt_tokens=len(prompt_ids), cached_tokens=cached)
                        continue
                    seen, msg = payload  # decode's GenerateResponse; its tokens start at output position `seen`
                    new = list(msg.token_ids)[max(0, emitted - seen):]
                    lps = list(msg.logprobs)[max(0, emitted - seen):] if msg.logprobs else [None] * len(new)
                    emitted = max(emitted, seen + len(msg.token_ids))
                    reason = FINISH_NAMES[finish_from_pb(msg.finish_reason)]
                    if new or reason:
                        yield TokenEvent(new, lps, finish_reason=reason, prompt_tokens=len(prompt_ids),
                                         cached_tokens=max(cached, msg.usage.cached_tokens))
                    if reason:
                        finished = True
                        return
        finally:
            for t in tasks:
                t.cancel()
            self.active.pop(request_id, None)
            if not finished:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await asyncio.shield(decode.decode.Abort(
                        common_pb2.AbortRequest(request_id=resv.reservation_id, reason="router"), timeout=5.0))

    async def _reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       hashes: list[bytes], md) -> tuple[Instance, decode_pb2.ReserveResponse]:
        tried: set[str] = set()
        while True:
            decode = self._pick(self.decode_pool, hashes, tried)
            try:
                with tracing.span("router.reserve", decode=decode.address):
                    resv = await decode.decode.Reserve(decode_pb2.ReserveRequest(
                        request_id=request_id, token_ids=prompt_ids, params=params_to_pb(params),
                        lease_ms=self.s.lease_ms), timeout=30.0, metadata=tracing.inject_metadata())
                self.s.block_size = resv.block_size or self.s.block_size
                decode.remember(hashes)
                return decode, resv
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or len(tried) >= self.s.max_retries:
                    raise _backend_error(f"decode {decode.address} Reserve", e) from e
                self.decode_pool.mark_failed(decode, e.details() or "unavailable")
                self.metrics.dispatch_retries_total.labels("decode", "unavailable").inc()
                tried.add(decode.address)

    async def _decode_stream(self, decode: Instance, reservation_id: str, md, events: asyncio.Queue) -> None:
        seen = 0
        try:
            call = decode.decode.Generate(decode_pb2.DecodeGenerateRequest(reservation_id=reservation_id),
                                          metadata=md, timeout=self.s.timeout_s)
            async for msg in call:
                await events.put(("decode", (seen, msg)))
                seen += len(msg.token_ids)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.decode_pool.mark_failed(decode, e.details() or "unavailable")
            await events.put(("error", _backend_error(f"decode {decode.address} Generate", e)))

    async def _prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams, hashes: list[bytes],
                       decode: Instance, resv: decode_pb2.ReserveResponse, md, events: asyncio.Queue) -> None:
        assert self.prefill_pool is not None
        req = prefill_pb2.PrefillRequest(
            request_id=request_id, token_ids=prompt_ids, params=params_to_pb(params),
            decode_address=decode.address, reservation_id=resv.reservation_id,
            num_skip_blocks=resv.num_cached_blocks, expected_layout_fingerprint=resv.layout.fingerprint,
            dest_block_ids=resv.block_ids, dest_transport_info=dict(resv.transport_info))
        if self.s.chunked_transfer is not None:
            req.chunked_transfer = self.s.chunked_transfer
        tried: set[str] = set()
        while True:
            try:
                prefill = self._pick(self.prefill_pool, hashes, tried)
            except BackendError as e:
                await events.put(("error", e))
                return
            try:
                with inflight(prefill), tracing.span("router.prefill", prefill=prefill.address):
                    resp = await prefill.prefill.Prefill(req, metadata=tracing.inject_metadata(),
                                                         timeout=self.s.timeout_s)
                prefill.remember(hashes)
                await events.put(("prefill", resp))
                return
            except grpc.aio.AioRpcError as e:
                retryable = (e.code() == grpc.StatusCode.UNAVAILABLE
                             and not (e.details() or "").startswith(KV_HANDOFF_FAILED))
                if retryable:
                    self.prefill_pool.mark_failed(prefill, e.details() or "unavailable")
                if not retryable or len(tried) >= self.s.max_retries:
                    await events.put(("error", _backend_error(f"prefill {prefill.address}", e)))
                    return
                log.warning("prefill %s failed before sending KV (%s); retrying elsewhere", prefill.address,
                            e.details())
                self.metrics.dispatch_retries_total.labels("prefill", "unavailable").inc()
                tried.add(prefill.address)

    async def _colocated(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                         hashes: list[bytes], md) -> AsyncIterator[TokenEvent]:
        worker = self._pick(self.decode_pool, hashes, set())
        self.active[request_id] = (worker, request_id)
        finished = False
        try:
            with inflight(worker):
                call = worker.decode.Generate(decode_pb2.DecodeGenerateRequest(
                    request_id=request_id, token_ids=prompt_ids, params=params_to_pb(params)),
                    metadata=md, timeout=self.s.timeout_s)
                worker.remember(hashes)
                async for msg in call:
                    reason = FINISH_NAMES[finish_from_pb(msg.finish_reason)]
                    yield TokenEvent(list(msg.token_ids), list(msg.logprobs) or [None] * len(msg.token_ids),
                                     finish_reason=reason, prompt_tokens=len(prompt_ids),
                                     cached_tokens=msg.usage.cached_tokens)
                    if reason:
                        finished = True
                        return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.decode_pool.mark_failed(worker, e.details() or "unavailable")
            raise _backend_error(f"worker {worker.address}", e) from e
        finally:
            self.active.pop(request_id, None)
            if not finished:
                with contextlib.suppress(grpc.aio.AioRpcError):
                    await asyncio.shield(worker.decode.Abort(
                        common_pb2.AbortRequest(request_id=request_id, reason="router"), timeout=5.0))
