"""OpenAI-compatible HTTP API over a :class:`TextPipeline` (aiohttp).

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models, GET /health,
GET /ready. Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web

from services.common.metrics import RouterMetrics
from services.engine.sampling_params import InvalidRequestError
from services.router.metering import metered
from services.router.openai_schema import APIError, GenerateRequest, parse_request
from services.router.pipeline import BackendError, TextDelta, TextPipeline, Usage

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.2
"""How often a request waiting on the backend checks whether its client is still connected."""

_BACKEND_STATUS = {"invalid_argument": 400, "not_found": 404, "resource_exhausted": 429,
                   "unavailable": 503, "internal": 500}
_BACKEND_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable_error", 500: "internal_server_error"}

PIPELINE_KEY = web.AppKey("pipeline", TextPipeline)
READY_KEY = web.AppKey("ready", Callable[[], bool])
METRICS_KEY = web.AppKey("metrics", RouterMetrics)

Deltas = AsyncGenerator[TextDelta, None]


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


def backend_api_error(e: BackendError) -> APIError:
    status = _BACKEND_STATUS.get(e.code, 500)
    return APIError(status, e.message, param=e.param, code=e.code, type=_BACKEND_TYPE[status])


def _error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return _error_response(e)
    except InvalidRequestError as e:
        return _error_response(APIError(400, str(e), param=e.field))
    except BackendError as e:
        return _error_response(backend_api_error(e))
    except ClientGone:
        return web.Response(status=499)  # nobody reads it; keeps the access log honest
    except web.HTTPRequestEntityTooLarge as e:
        return _error_response(APIError(413, f"request body too large: {e.text}", code="request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(APIError(e.status, f"{request.method} {request.path}: {e.reason}",
                                        code=e.reason.lower().replace(" ", "_")))


def make_app(pipeline: TextPipeline, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             ready: Callable[[], bool] | None = None, metrics: RouterMetrics | None = None) -> web.Application:
    """The OpenAI HTTP application.

    ``ready`` answers GET /ready (default: always ready); ``metrics``, when given, times every
    generation (client TTFT/ITL/e2e, counters) through :func:`services.router.metering.metered`."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors])
    app[PIPELINE_KEY] = pipeline
    app[READY_KEY] = ready or (lambda: True)
    if metrics is not None:
        app[METRICS_KEY] = metrics
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    return app


# --- simple routes ---


async def _models(request: web.Request) -> web.Response:
    p = request.app[PIPELINE_KEY]
    card = {"id": p.model_name(), "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": p.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    if request.app[READY_KEY]():
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready"}, status=503)


# --- generation routes ---


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e


def _prompt_ids(pipeline: TextPipeline, req: GenerateRequest) -> list[int]:
    if req.messages is not None:
        return pipeline.encode_chat(req.messages)
    if req.prompt_ids is not None:
        return req.prompt_ids
    assert req.prompt_text is not None
    return pipeline.encode_text(req.prompt_text)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    arrival = time.monotonic()
    pipeline = request.app[PIPELINE_KEY]
    req = parse_request(await _read_json(request), chat=chat)
    served = pipeline.model_name()
    if req.model is not None and req.model != served:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
    prompt_ids = await asyncio.to_thread(_prompt_ids, pipeline, req)
    pipeline.check(prompt_ids, req.params, max_tokens=req.max_tokens, prompt_field=req.prompt_field)
    fmt = _Formatter(pipeline, req, served)
    inner = pipeline.generate(fmt.id, prompt_ids, req.params)
    metrics = request.app.get(METRICS_KEY)
    deltas = inner if metrics is None else metered(inner, metrics, served, arrival)
    try:
        if req.stream:
            return await _stream(request, fmt, deltas)
        return await _until_disconnect(request, _collect(fmt, deltas))
    finally:  # outer first: closing the pipeline's generator is what aborts the backend request
        await deltas.aclose()
        await inner.aclose()


async def _until_disconnect(request: web.Request, coro: Awaitable[Any]) -> Any:
    """Await ``coro`` in a task; cancel it (aborting the generation) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            transport = request.transport
            if transport is None or transport.is_closing():
                raise ClientGone(f"{request.method} {request.path}: client disconnected")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _collect(fmt: _Formatter, deltas: Deltas) -> web.Response:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    last = TextDelta("")
    async for d in deltas:
        text.append(d.text)
        token_ids.extend(d.token_ids)
        logprobs.extend(d.logprobs)
        last = d
    full = TextDelta("".join(text), token_ids, logprobs, last.finish_reason, last.usage)
    return web.json_response(fmt.full(full))


async def _stream(request: web.Request, fmt: _Formatter, deltas: Deltas) -> web.StreamResponse:
    # Before the first event, a backend error still gets a plain HTTP error status.
    first = await _until_disconnect(request, anext(deltas))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        await _until_disconnect(request, _pump(resp, fmt, first, deltas))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ClientGone, ConnectionResetError) as e:
        log.info("%s: client went away mid-stream (%s); generation aborted", fmt.id, type(e).__name__)
    return resp


async def _pump(resp: web.StreamResponse, fmt: _Formatter, first: TextDelta, deltas: Deltas) -> None:
    async def send(obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

    try:
        if fmt.req.chat:
            await send(fmt.chunk(TextDelta(""), role=True))
        d: TextDelta | None = first
        while d is not None:
            if d.text or d.finish_reason is not None or (d.token_ids and fmt.req.logprobs):
                await send(fmt.chunk(d))
            if d.finish_reason is not None:
                if fmt.req.include_usage and d.usage is not None:
                    await send(fmt.usage_chunk(d.usage))
                return
            d = await anext(deltas, None)
    except (APIError, InvalidRequestError, BackendError) as e:
        api = e if isinstance(e, APIError) else (
            backend_api_error(e) if isinstance(e, BackendError) else APIError(400, str(e), param=e.field))
        log.warning("%s: failed mid-stream: %s", fmt.id, api.message)
        await send(api.body())


class _Formatter:
    """Builds the OpenAI response objects of one request."""

    def __init__(self, pipeline: TextPipeline, req: GenerateRequest, model: str) -> None:
        self.pipeline = pipeline
        self.req = req
        self.model = model
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _logprobs(self, d: TextDelta) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        tokens = [self.pipeline.token_text(t) for t in d.token_ids]
        lps = list(d.logprobs) + [None] * (len(tokens) - len(d.logprobs))
        # Only the chosen token's logprob is known: top_logprobs lists hold just that token.
        if self.req.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())}]
                 if self.req.top_logprobs else []}
                for s, lp in zip(tokens, lps, strict=True)]}
        offsets = []
        for s in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps,
                "top_logprobs": [{s: lp} for s, lp in zip(tokens, lps, strict=True)] if self.req.top_logprobs
                else None,
                "text_offset": offsets}

    @staticmethod
    def _usage(u: Usage | None) -> dict[str, Any] | None:
        if u is None:
            return None
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}

    def full(self, d: TextDelta) -> dict[str, Any]:
        if self.req.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": d.text},
                                      "logprobs": self._logprobs(d), "finish_reason": d.finish_reason}
            body = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": d.text, "logprobs": self._logprobs(d), "finish_reason": d.finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        body["usage"] = self._usage(d.usage)
        return body

    def chunk(self, d: TextDelta, role: bool = False) -> dict[str, Any]:
        if self.req.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {"content": d.text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None if role else self._logprobs(d),
                                      "finish_reason": d.finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": d.text, "logprobs": self._logprobs(d), "finish_reason": d.finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if self.req.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        body = self._head("chat.completion.chunk" if self.req.chat else "text_completion")
        body["choices"] = []
        body["usage"] = self._usage(u)
        return body
