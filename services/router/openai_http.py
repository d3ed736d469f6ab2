"""OpenAI-compatible HTTP API over a :class:`TextPipeline` (aiohttp).

Routes: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
GET /v1/models/{model}, GET /health, GET /ready, and GET /metrics when given a registry. Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.

Every generation request ends in one of three ways a client can tell apart:

- completed: HTTP 200, finish_reason ``stop`` or ``length``; a stream ends with ``data: [DONE]``;
- refused or failed before the first byte: 4xx/5xx with a JSON error (429 and 503 carry Retry-After,
  401 carries ``WWW-Authenticate: Bearer``, 504 when the request's deadline passed); after the first
  byte: one SSE event ``data: {"error": {...}}`` and the stream ends with no ``[DONE]``;
- the client went away: the generation is aborted (counted ``cancelled``).

Deadline: ``X-Request-Timeout: <seconds>`` (a positive number) bounds one request, capped by the
router's ``request_timeout_s`` (the bound when the header is absent). Slow clients: a request body must
arrive within ``read_timeout_s`` (else 408), and a connection whose request head does not arrive within
it is closed (:func:`make_runner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from services.common.metrics import RouterMetrics, render_metrics
from services.router.auth import APIKeys
from services.router.metering import RequestMeter, RequestRecord, code_for_http_status
from services.router.openai_format import Formatter
from services.router.openai_schema import (
    CONTEXT_LENGTH_EXCEEDED,
    INVALID_VALUE,
    APIError,
    GenerateRequest,
    load_json,
    parse_request,
)
from services.router.pipeline import DEFAULT_RETRY_AFTER_S, BackendError, TextDelta, TextPipeline
from services.text.sampling_params import InvalidRequestError, TopLogprobs

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DISCONNECT_POLL_S = 0.2
"""How often a request waiting on the backend checks whether its client is still connected."""
TIMEOUT_HEADER = "X-Request-Timeout"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})

_BACKEND_STATUS = {"invalid_argument": 400, "not_found": 404, "resource_exhausted": 429,
                   "unavailable": 503, "internal": 500, "deadline_exceeded": 504}
_BACKEND_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
                 503: "service_unavailable_error", 500: "internal_server_error", 504: "timeout_error"}


@dataclass(frozen=True)
class HTTPSettings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    read_timeout_s: float = 30.0
    """Longest wait for a request's head (then the connection closes) or body (then 408), seconds."""
    request_timeout_s: float = 600.0
    """Longest a generation request may run, seconds; X-Request-Timeout can only shorten it."""


PIPELINE_KEY = web.AppKey("pipeline", TextPipeline)
READY_KEY = web.AppKey("ready", Callable[[], bool])
METER_KEY = web.AppKey("meter", RequestMeter)
KEYS_KEY = web.AppKey("api_keys", APIKeys)
SETTINGS_KEY = web.AppKey("settings", HTTPSettings)
RECORD_KEY = web.RequestKey("record", RequestRecord)

Deltas = AsyncGenerator[TextDelta, None]


class ClientGone(Exception):
    """The client closed the connection before the response was complete."""


def retry_after_header(seconds: float | None) -> dict[str, str]:
    """Retry-After in whole seconds (the header allows no fraction), at least 1."""
    return {"Retry-After": str(max(1, math.ceil(DEFAULT_RETRY_AFTER_S if seconds is None else seconds)))}


def backend_api_error(e: BackendError) -> APIError:
    status = _BACKEND_STATUS.get(e.code, 500)
    headers = retry_after_header(e.retry_after_s) if status in (429, 503, 504) else {}
    return APIError(status, e.message, param=e.param, code=e.code, type=_BACKEND_TYPE[status], headers=headers)


def _api_error(e: Exception) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, BackendError):
        return backend_api_error(e)
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.field, code=e.code)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal", type="internal_server_error")


def _error_response(e: APIError) -> web.Response:
    resp = web.json_response(e.body(), status=e.status, headers=e.headers)
    if e.status == 408:
        resp.force_close()  # the rest of the body may still be on its way
    return resp


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """Outermost: every failure becomes an OpenAI JSON error (never aiohttp's plain-text 500)."""
    try:
        return await handler(request)
    except (APIError, InvalidRequestError, BackendError) as e:
        return _error_response(_api_error(e))
    except (ClientGone, ConnectionResetError):
        return web.Response(status=499)  # nobody reads it; keeps the access log honest
    except web.HTTPRequestEntityTooLarge as e:
        return _error_response(APIError(413, f"request body too large: {e.text}", code="request_too_large"))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(APIError(e.status, f"{request.method} {request.path}: {e.reason}",
                                        code=e.reason.lower().replace(" ", "_")))
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        return _error_response(_api_error(e))


@web.middleware
async def _account(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """Generation requests: one RequestRecord each, whatever ends them (401s and 400s included)."""
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return await handler(request)
    with request.app[METER_KEY].request() as rec:
        request[RECORD_KEY] = rec
        try:
            resp = await handler(request)
            rec.wire_status = str(resp.status)
            return resp
        except APIError as e:
            rec.wire_status = str(e.status)
            rec.fail(code_for_http_status(e.status))
            raise
        except InvalidRequestError:
            rec.wire_status = "400"
            rec.fail("invalid_argument")
            raise
        except BackendError as e:
            rec.wire_status = str(backend_api_error(e).status)
            raise
        except web.HTTPException as e:
            rec.wire_status = str(e.status)
            if e.status >= 400:
                rec.fail(code_for_http_status(e.status))
            raise
        except (ClientGone, ConnectionResetError):
            rec.wire_status = "499"
            rec.cancel()
            raise


@web.middleware
async def _auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                ) -> web.StreamResponse:
    """/v1/* needs ``Authorization: Bearer <key>`` when keys are configured; /health and /ready never."""
    if request.path.startswith("/v1/") and not request.app[KEYS_KEY].allows(request.headers.get("Authorization")):
        raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    return await handler(request)


def make_app(pipeline: TextPipeline, *, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             ready: Callable[[], bool] | None = None, metrics: RouterMetrics | None = None,
             meter: RequestMeter | None = None, api_keys: APIKeys | None = None,
             read_timeout_s: float = 30.0, request_timeout_s: float = 600.0,
             registry: CollectorRegistry | None = None) -> web.Application:
    """The OpenAI HTTP application.

    ``ready`` answers GET /ready (default: always ready). ``meter`` admits and accounts every
    generation request (share one with the gRPC API); without it one is made over ``metrics`` (None:
    no metrics) with the default in-flight bound. ``api_keys``: None or empty leaves /v1/* open.
    ``registry``: also serve it at GET /metrics (no API key, like /health)."""
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors, _account, _auth])
    app[PIPELINE_KEY] = pipeline
    app[READY_KEY] = ready or (lambda: True)
    app[METER_KEY] = meter or RequestMeter(metrics, pipeline.model_name())
    app[KEYS_KEY] = api_keys or APIKeys()
    app[SETTINGS_KEY] = HTTPSettings(max_body_bytes, read_timeout_s, request_timeout_s)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model:.+}", _model)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    if registry is not None:
        app.router.add_get("/metrics", partial(_metrics, registry))
    return app


def make_runner(app: web.Application) -> web.AppRunner:
    """The app's runner: a connection idle (no complete request head) for read_timeout_s is closed,
    on its first request as between keep-alive requests; the rest of a body answered before it was
    read (408, 413) is drained for at most read_timeout_s before the connection closes."""
    timeout_s = app[SETTINGS_KEY].read_timeout_s
    return web.AppRunner(app, handle_signals=False, access_log=None, keepalive_timeout=timeout_s,
                         lingering_time=timeout_s)


# --- simple routes ---


def _card(p: TextPipeline) -> dict[str, Any]:
    return {"id": p.model_name(), "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": p.max_model_len}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_card(request.app[PIPELINE_KEY])]})


async def _model(request: web.Request) -> web.Response:
    p = request.app[PIPELINE_KEY]
    name = request.match_info["model"]
    if name != p.model_name():
        raise APIError(404, f"model {name!r} does not exist; this server serves {p.model_name()!r}",
                       param="model", code="model_not_found")
    return web.json_response(_card(p))


async def _metrics(registry: CollectorRegistry, request: web.Request) -> web.Response:
    body, content_type = render_metrics(registry)
    return web.Response(body=body, headers={"Content-Type": content_type})


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


def _timeout_s(request: web.Request, cap_s: float) -> float:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return cap_s
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise APIError(400, f"{TIMEOUT_HEADER}: must be a positive number of seconds, got {raw[:40]!r}",
                       param=TIMEOUT_HEADER, code=INVALID_VALUE)
    return min(value, cap_s)


async def _read_json(request: web.Request, timeout_s: float) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                       code="request_timeout") from None
    return load_json(raw)


def _prompt_ids(pipeline: TextPipeline, req: GenerateRequest) -> list[int]:
    if req.messages is not None:
        return pipeline.encode_chat(req.messages)
    if req.prompt_ids is not None:
        return req.prompt_ids
    assert req.prompt_text is not None
    return pipeline.encode_text(req.prompt_text)


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    rec = request[RECORD_KEY]
    settings = request.app[SETTINGS_KEY]
    rec.admit()  # 429 past max in-flight, before any work on the body
    deadline = time.time() + _timeout_s(request, settings.request_timeout_s)  # Unix seconds
    pipeline = request.app[PIPELINE_KEY]
    req = parse_request(await _read_json(request, settings.read_timeout_s), chat=chat)
    served = pipeline.model_name()
    if req.model is not None and req.model != served:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
    prompt_ids = await asyncio.to_thread(_prompt_ids, pipeline, req)
    try:
        pipeline.check(prompt_ids, req.params, max_tokens=req.max_tokens, prompt_field=req.prompt_field)
    except InvalidRequestError as e:
        if e.code != CONTEXT_LENGTH_EXCEEDED:
            raise
        # OpenAI names the prompt (messages / prompt) even when max_tokens tipped it over: the prompt
        # is what a client shortens.
        raise APIError(400, str(e), param=req.prompt_field, code=e.code) from None
    fmt = Formatter(pipeline, req, served)
    rec.request_id, rec.prompt_tokens = fmt.id, len(prompt_ids)
    inner = pipeline.generate(fmt.id, prompt_ids, req.params, deadline=deadline)
    deltas = rec.observe(inner)
    try:
        if req.stream:
            return await _stream(request, fmt, deltas, rec)
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


async def _collect(fmt: Formatter, deltas: Deltas) -> web.Response:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float | None] = []
    tops: list[TopLogprobs | None] = []
    last = TextDelta("")
    async for d in deltas:
        n = len(d.token_ids)  # per-position lists padded to the delta's tokens, so positions stay aligned
        text.append(d.text)
        token_ids.extend(d.token_ids)
        logprobs.extend((list(d.logprobs) + [None] * n)[:n])
        tops.extend((list(d.top_logprobs) + [None] * n)[:n])
        last = d
    if last.finish_reason is None:  # the pipeline raises instead; never answer an unfinished 200
        raise BackendError("internal", f"{fmt.id}: the generation ended without a finish reason")
    full = TextDelta("".join(text), token_ids, logprobs, tops, last.finish_reason, last.usage)
    return web.json_response(fmt.full(full))


async def _stream(request: web.Request, fmt: Formatter, deltas: Deltas, rec: RequestRecord) -> web.StreamResponse:
    # Before the first event, a failure still gets a plain HTTP error status (raised from here).
    first = await _until_disconnect(request, anext(deltas))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    try:
        await resp.prepare(request)
        if await _until_disconnect(request, _pump(resp, fmt, first, deltas, rec)):
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except (ClientGone, ConnectionResetError) as e:
        rec.cancel()
        log.info("%s: client went away mid-stream (%s); generation aborted", fmt.id, type(e).__name__)
    return resp


async def _pump(resp: web.StreamResponse, fmt: Formatter, first: TextDelta, deltas: Deltas,
                rec: RequestRecord) -> bool:
    """Write the SSE events; True when the generation completed, False after a failure, which is
    written as one error event (the caller then ends the stream without [DONE])."""
    async def send(obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + Formatter.dumps(obj) + b"\n\n")

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
                return True
            d = await anext(deltas, None)
        raise BackendError("internal", f"{fmt.id}: the generation ended without a finish reason")
    except (ClientGone, ConnectionResetError):
        raise
    except Exception as e:
        api = _api_error(e)
        if api.status == 500 and not isinstance(e, BackendError):
            log.exception("%s: failed mid-stream", fmt.id)
        else:
            log.warning("%s: failed mid-stream: %s", fmt.id, api.message)
        rec.fail(e.code if isinstance(e, BackendError) else code_for_http_status(api.status))
        await send(api.body())
        return False
