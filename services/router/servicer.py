"""The router's gRPC API: Generate (server stream) and Abort, over the same pipeline as HTTP."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc

from services.common import tracing
from services.common.convert import params_from_pb
from services.common.grpc_util import abort_if_draining
from services.common.metrics import RouterMetrics
from services.common.pb import common_pb2, router_pb2, router_pb2_grpc
from services.engine.sampling_params import InvalidRequestError
from services.router.metering import metered
from services.router.pipeline import BackendError, TextPipeline

DEFAULT_MAX_TOKENS = 16
_STATUS = {"invalid_argument": grpc.StatusCode.INVALID_ARGUMENT, "not_found": grpc.StatusCode.NOT_FOUND,
           "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED, "unavailable": grpc.StatusCode.UNAVAILABLE,
           "internal": grpc.StatusCode.INTERNAL}
_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "abort": common_pb2.FINISH_REASON_ABORT, None: common_pb2.FINISH_REASON_UNSPECIFIED}


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, pipeline: TextPipeline, metrics: RouterMetrics, served_name: str, draining) -> None:
        self.pipeline = pipeline
        self.metrics = metrics
        self.served_name = served_name
        self.draining = draining
        self.inflight: set[str] = set()

    def _prompt(self, request: router_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return self.pipeline.encode_text(request.text)
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            vocab = self.pipeline.tokenizer.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError("token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
            return ids
        if which == "chat":
            msgs = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            for i, m in enumerate(msgs):
                if not m["role"]:
                    raise InvalidRequestError(f"chat.messages[{i}].role", "must not be empty")
            return self.pipeline.encode_chat(msgs, True)
        raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")

    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        arrival = time.monotonic()
        await abort_if_draining(context, self.draining, "router")
        if request.model and request.model != self.served_name:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {request.model!r} is not served here (serving {self.served_name!r})")
        rid = request.request_id or f"req-{uuid.uuid4().hex}"
        if rid in self.inflight:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in flight")
        try:
            ids = self._prompt(request)
            pb_params = common_pb2.SamplingParams()
            pb_params.CopyFrom(request.params)
            max_tokens = pb_params.max_tokens or DEFAULT_MAX_TOKENS
            if max_tokens < 0:
                raise InvalidRequestError("max_tokens", f"must be > 0, got {max_tokens}")
            pb_params.max_tokens = max_tokens
            params = self.pipeline.check(ids, params_from_pb(pb_params), max_tokens=max_tokens)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.inflight.add(rid)
        acc = common_pb2.GenerateResponse(request_id=rid)
        try:
            with tracing.span_from_metadata("router.request", context.invocation_metadata(), request_id=rid,
                                            prompt_tokens=len(ids)):
                async for d in metered(self.pipeline.generate(rid, ids, params), self.metrics,
                                       self.served_name, arrival):
                    msg = common_pb2.GenerateResponse(request_id=rid, token_ids=d.token_ids, text=d.text,
                                                      finish_reason=_FINISH[d.finish_reason])
                    if params.logprobs:
                        msg.logprobs.extend(lp or 0.0 for lp in d.logprobs)
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
                        acc.finish_reason = msg.finish_reason
                        if msg.HasField("usage"):
                            acc.usage.CopyFrom(msg.usage)
            if not request.stream:
                yield acc
        except BackendError as e:
            await context.abort(_STATUS.get(e.code, grpc.StatusCode.INTERNAL), e.message)
        finally:
            self.inflight.discard(rid)

    async def Abort(self, request: common_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: must not be empty")
        found = request.request_id in self.inflight
        await self.pipeline.backend.abort(request.request_id)
        return common_pb2.AbortResponse(found=found)
