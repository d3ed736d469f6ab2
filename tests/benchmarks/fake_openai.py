"""A scripted OpenAI-compatible streaming server for the load generator's tests.

The last user message (chat) or the prompt (completions) picks the behaviour: ``FAIL503`` answers
503 before streaming, ``MIDSTREAM`` sends one token then an error event (no [DONE]), ``TRUNCATE``
sends one token and ends without a finish_reason, ``EMPTY`` finishes without a token, ``NOTEXT`` streams no text but counts ``max_tokens`` in usage; anything else
streams ``max_tokens`` tokens ("t0 t1 ...") with usage (prompt tokens = words of the prompt)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def _prompt(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(m["content"] for m in body["messages"])
    return str(body["prompt"])


async def _stream(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("chat/completions")
    text = _prompt(body)
    last = body["messages"][-1]["content"] if chat else text
    if "FAIL503" in last:
        return web.json_response({"error": {"message": "overloaded", "code": 503}}, status=503)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)

    async def send(obj: dict[str, Any]) -> None:
        await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def chunk(piece: str, finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": piece}
        else:
            choice["text"] = piece
        return {"choices": [choice]}

    n = 0 if "EMPTY" in last else int(body["max_tokens"])
    for i in range(0 if "NOTEXT" in last else n):
        await send(chunk(f" t{i}"))
        if "MIDSTREAM" in last:
            await send({"error": {"message": "decode died", "code": 503}})
            return resp
        if "TRUNCATE" in last:
            return resp
    await send(chunk("", "length"))
    await send({"choices": [], "usage": {"prompt_tokens": len(text.split()), "completion_tokens": n,
                                         "total_tokens": len(text.split()) + n}})
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _models(_request: web.Request) -> web.Response:
    return web.json_response({"data": [{"id": "fake-model"}]})


def app() -> web.Application:
    a = web.Application()
    a.router.add_post("/v1/chat/completions", _stream)
    a.router.add_post("/v1/completions", _stream)
    a.router.add_get("/v1/models", _models)
    return a
