"""The router's gRPC API: Generate (server stream) and Abort, over the same pipeline as HTTP.

Failures are gRPC statuses with a typed ErrorDetail (services.common.grpc_util.abort), never an error
inside a success message: INVALID_ARGUMENT (the field named), UNAUTHENTICATED (API keys set and the
``authorization`` metadata is not ``Bearer <key>``), RESOURCE_EXHAUSTED past the router's in-flight bound
and UNAVAILABLE (both with retry_after_ms), DEADLINE_EXCEEDED. The call's gRPC deadline is the request's
deadline, capped by ``request_timeout_s``. finish_reason is only ever STOP or LENGTH.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from services.common import tracing
from services.common.grpc_util import Reason, abort, abort_if_draining, error_detail
from services.common.metrics import RouterMetrics
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.router.auth import APIKeys
from services.router.metering import RequestMeter, RequestRecord
from services.router.pipeline import DEFAULT_RETRY_AFTER_S, BackendError, TextPipeline
from services.text.sampling_params import InvalidRequestError, SamplingParams
from services.text.sampling_pb import params_from_pb

DEFAULT_MAX_TOKENS = 16
DEADLINE_MARGIN_S = 0.05
"""The router gives a request up this long before the caller's gRPC deadline, so the caller gets the
router's DEADLINE_EXCEEDED (with its detail) and the request is counted as such, not as a cancel."""
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}
_REASON = {"invalid_argument": (Reason.ERROR_REASON_INVALID_INPUT, False),
           "resource_exhausted": (Reason.ERROR_REASON_OVERLOADED, True),
           "unavailable": (Reason.ERROR_REASON_UNSPECIFIED, True),
           "deadline_exceeded": (Reason.ERROR_REASON_DEADLINE, True),  # the cluster was slow: the same request may fit
           "unauthenticated": (Reason.ERROR_REASON_PERMISSION, False)}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, pipeline: TextPipeline, metrics: RouterMetrics | None, served_name: str,
                 draining: asyncio.Event, *, meter: RequestMeter | None = None, api_keys: APIKeys | None = None,
                 request_timeout_s: float = 600.0) -> None:
        """``meter``: share the HTTP API's (one in-flight bound for both); default: one over ``metrics``."""
        self.pipeline = pipeline
        self.served_name = served_name
        self.draining = draining
        self.meter = meter or RequestMeter(metrics, served_name)
        self.api_keys = api_keys or APIKeys()
        self.request_timeout_s = request_timeout_s
        self.inflight: set[str] = set()

    async def _fail(self, context: grpc.aio.ServicerContext, rec: RequestRecord | None, code: str, message: str, *,
                    field: str = "", retry_after_s: float | None = None) -> NoReturn:
        """Record the outcome, then end the RPC with status ``code`` (lower-case gRPC name)."""
        if rec is not None:
            rec.fail(code)
            rec.wire_status = code.upper()
        reason, retryable = _REASON.get(code, (Reason.ERROR_REASON_UNSPECIFIED, False))
        retry_ms = 0
        if retryable:
            retry_ms = max(1, math.ceil(1000 * (DEFAULT_RETRY_AFTER_S if retry_after_s is None else retry_after_s)))
        await abort(context, grpc.StatusCode[code.upper()], message,
                    error_detail(reason, retryable=retryable, side="router", field=field, retry_after_ms=retry_ms))

    async def _authorize(self, context: grpc.aio.ServicerContext, rec: RequestRecord | None) -> None:
        if not self.api_keys.required:
            return
        md = {k.lower(): v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        if not self.api_keys.allows(md.get("authorization")):
            await self._fail(context, rec, "unauthenticated",
                             "a valid API key is required: send metadata 'authorization: Bearer <key>'")

    def _prompt(self, request: router_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return self.pipeline.encode_text(request.text, "text")
        if which == "token_ids":
            return list(request.token_ids.ids)  # range-checked against the vocabulary by pipeline.check
        if which == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            for i, m in enumerate(msgs):
                if not m["role"]:
                    raise InvalidRequestError(f"chat.messages[{i}].role", "must not be empty")
            return self.pipeline.encode_chat(msgs, True)
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")

    def _params(self, request: router_pb2.GenerateRequest, ids: list[int]) -> SamplingParams:
        pb_params = common_pb2.SamplingParams()
        pb_params.CopyFrom(request.params)
        max_tokens = pb_params.max_tokens or DEFAULT_MAX_TOKENS
        if max_tokens < 0:
            raise InvalidRequestError("max_tokens", f"must be > 0, got {max_tokens}")
        if pb_params.HasField("temperature") and not math.isfinite(pb_params.temperature):
            raise InvalidRequestError("temperature", f"must be a finite number, got {pb_params.temperature}")
        pb_params.max_tokens = max_tokens
        field = {"text": "text", "token_ids": "token_ids", "chat": "chat"}.get(request.WhichOneof("prompt") or "",
                                                                             "prompt")
        return self.pipeline.check(ids, params_from_pb(pb_params), max_tokens=max_tokens, prompt_field=field)

    def _deadline(self, context: grpc.aio.ServicerContext) -> float:
        """Unix seconds: the call's gRPC deadline (less DEADLINE_MARGIN_S), capped by request_timeout_s."""
        remaining = context.time_remaining()
        if remaining is None:
            return time.time() + self.request_timeout_s
        return time.time() + min(max(0.0, remaining - DEADLINE_MARGIN_S), self.request_timeout_s)

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        with self.meter.request(api="grpc") as rec:
            await self._authorize(context, rec)
            if self.draining.is_set():
                rec.fail("unavailable")
                await abort_if_draining(context, self.draining, "router")
            try:
                rec.admit()
            except BackendError as e:
                await self._fail(context, rec, e.code, e.message, retry_after_s=e.retry_after_s)
            deadline = self._deadline(context)
            if request.model and request.model != self.served_name:
                await self._fail(context, rec, "not_found", f"model {request.model!r} is not served here "
                                                            f"(serving {self.served_name!r})", field="model")
            rid = request.request_id or f"req-{uuid.uuid4().hex}"
            if rid in self.inflight:
                await self._fail(context, rec, "already_exists", f"request_id {rid!r} is already in flight",
                                 field="request_id")
            try:
                ids = self._prompt(request)
                params = self._params(request, ids)
            except InvalidRequestError as e:
                await self._fail(context, rec, "invalid_argument", str(e), field=e.field)
            self.inflight.add(rid)
            rec.request_id, rec.prompt_tokens = rid, len(ids)
            try:
                # aclosing: a client that cancels closes this generator at its yield; closing the chain
                # below is what aborts the backend request at once.
                async with contextlib.aclosing(self._generate(request, context, rec, rid, ids, params,
                                                              deadline)) as responses:
                    async for msg in responses:
                        yield msg
            except BackendError as e:
                await self._fail(context, rec, e.code, e.message, field=e.param or "",
                                 retry_after_s=e.retry_after_s)
            finally:
                self.inflight.discard(rid)

    async def _generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        rec: RequestRecord, rid: str, ids: list[int], params: SamplingParams, deadline: float
                        ) -> AsyncIterator[common_pb2.GenerateResponse]:
        acc = common_pb2.GenerateResponse(request_id=rid)
        deltas = rec.observe(self.pipeline.generate(rid, ids, params, deadline=deadline))
        with tracing.span_from_metadata("router.request", context.invocation_metadata(), request_id=rid,
                                        prompt_tokens=len(ids)):
            async with contextlib.aclosing(deltas):  # type: ignore[type-var]
                async for d in deltas:
                    msg = common_pb2.GenerateResponse(request_id=rid, token_ids=d.token_ids, text=d.text)
                    if d.finish_reason is not None:
                        msg.finish_reason = _FINISH[d.finish_reason]
                    if params.logprobs:
                        msg.logprobs.extend(lp or 0.0 for lp in d.logprobs)
                    if params.top_logprobs:
                        tops = list(d.top_logprobs) + [None] * (len(d.token_ids) - len(d.top_logprobs))
                        msg.top_logprobs.extend(common_pb2.TopLogprobs(token_ids=t.token_ids, logprobs=t.logprobs)
                                                if t is not None else common_pb2.TopLogprobs() for t in tops)
                    if d.usage is not None:
                        msg.usage.CopyFrom(common_pb2.Usage(prompt_tokens=d.usage.prompt_tokens,
                                                            completion_tokens=d.usage.completion_tokens,
                                                            cached_tokens=d.usage.cached_tokens))
                    if request.stream:
                        yield msg
                    else:
                        acc.token_ids.extend(msg.token_ids)
                        acc.text += msg.text
                        acc.logprobs.extend(msg.logprobs)
                        acc.top_logprobs.extend(msg.top_logprobs)
                        acc.finish_reason = msg.finish_reason
                        if msg.HasField("usage"):
                            acc.usage.CopyFrom(msg.usage)
        if not request.stream:
            yield acc

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        await self._authorize(context, None)
        if not request.request_id:
            await self._fail(context, None, "invalid_argument", "request_id: must not be empty", field="request_id")
        found = request.request_id in self.inflight
        await self.pipeline.backend.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)
