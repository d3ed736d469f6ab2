"""One streamed request to an OpenAI-compatible server, timed on the client, classified on failure.

Times are ``time.perf_counter()`` seconds. TTFT is request sent -> first event carrying output (text,
or tokens when logprobs are asked for); each later such event adds one inter-token gap (ITL, per
streamed event: a server that batches several tokens into one event shows fewer, longer gaps).

Every request ends as exactly one :class:`RequestResult`: ``ok`` (a finish_reason arrived and the
stream ended cleanly), or a failure with ``error`` one of :data:`ERROR_KINDS`:

- ``http_<status>``: the server answered an error status before streaming (429, 503, 400 ...);
- ``stream_error``: an error event arrived mid-stream (pdserve sends one and no ``[DONE]``);
- ``incomplete``: the stream ended without a finish_reason;
- ``empty``: completed without a single output token (no text and usage counting none; a completion whose
  usage counts tokens that form no text, as a random model's ids past a byte vocabulary do, is completed, with
  no TTFT or ITL: the client saw no token arrive);
- ``timeout``: no answer within ``--timeout-s``; ``connection``: refused, reset or closed early;
- ``bad_response``: an event that is not the JSON an OpenAI server sends.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

ERROR_KINDS = ("http_<status>", "stream_error", "incomplete", "empty", "timeout", "connection", "bad_response")


@dataclass
class RequestResult:
    conversation: str
    turn: int
    start: float
    """Seconds since the run's clock started, when the request was sent."""
    ok: bool = False
    error: str = ""
    detail: str = ""
    status: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    event_times: list[float] = field(default_factory=list)
    """Seconds after ``start`` of each output-carrying event."""
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    """From the server's ``usage`` (None when it sent none)."""
    completion_tokens: int | None = None
    client_prompt_tokens: int | None = None
    """Counted with the client's tokenizer (None without one)."""
    client_completion_tokens: int | None = None
    tokens: list[str] | None = None
    """Output token strings from logprobs, when asked for."""

    @property
    def output_tokens(self) -> int | None:
        return self.completion_tokens if self.completion_tokens is not None else self.client_completion_tokens

    @property
    def input_tokens(self) -> int | None:
        return self.prompt_tokens if self.prompt_tokens is not None else self.client_prompt_tokens

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None below two tokens."""
        n = self.output_tokens
        if self.ttft is None or n is None or n < 2:
            return None
        return (self.e2e - self.ttft) / (n - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.event_times, self.event_times[1:], strict=False)]


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are asked."""

    base_url: str
    """OpenAI base URL (``http://host:port/v1``; a bare ``http://host:port`` gets ``/v1``)."""
    model: str
    api: str = "chat"
    api_key: str = ""
    temperature: float = 0.0
    ignore_eos: bool = True
    logprobs: bool = False
    timeout_s: float = 600.0

    @property
    def base(self) -> str:
        base = self.base_url.rstrip("/")
        return base + "/v1" if base.count("/") == 2 else base  # scheme://host[:port] with no path

    @property
    def url(self) -> str:
        return f"{self.base}/{'chat/completions' if self.api == 'chat' else 'completions'}"

    def body(self, payload: list[dict[str, str]] | str, max_tokens: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "temperature": self.temperature,
                                "stream": True, "stream_options": {"include_usage": True}}
        body["messages" if self.api == "chat" else "prompt"] = payload
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.logprobs:
            body["logprobs"] = True if self.api == "chat" else 1
        return body

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"}
                                                       if self.api_key else {})}


def _event_tokens(choice: dict[str, Any], chat: bool) -> list[str]:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return []
    if chat:
        return [str(t.get("token", "")) for t in lp.get("content") or [] if isinstance(t, dict)]
    return [str(t) for t in lp.get("tokens") or []]


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error")
    if isinstance(err, dict):
        return f"{err.get('code') or err.get('type') or ''}: {err.get('message', '')}".strip(": ")
    return str(err)


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, t0: float, chat: bool,
                       want_tokens: bool) -> None:
    """Fill ``res`` from an SSE body; sets ok/error."""
    done = False
    parts: list[str] = []
    tokens: list[str] = []
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            res.error, res.detail = "bad_response", data[:200].decode("utf-8", "replace")
            return
        if not isinstance(obj, dict):
            res.error, res.detail = "bad_response", str(obj)[:200]
            return
        if "error" in obj:
            res.error, res.detail = "stream_error", _error_text(obj)[:300]
            return
        usage = obj.get("usage")
        if isinstance(usage, dict):
            res.prompt_tokens = usage.get("prompt_tokens")
            res.completion_tokens = usage.get("completion_tokens")
        for choice in obj.get("choices") or []:
            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
            toks = _event_tokens(choice, chat) if want_tokens else []
            if text or toks:
                now = time.perf_counter() - t0
                if res.ttft is None:
                    res.ttft = now
                res.event_times.append(now)
                parts.append(text or "")
                tokens += toks
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
    res.text = "".join(parts)
    res.tokens = tokens if want_tokens else None
    if res.finish_reason is None:
        res.error, res.detail = "incomplete", "no finish_reason" + ("" if done else " and no [DONE]")
    elif not res.event_times and not res.completion_tokens:
        res.error, res.detail = "empty", f"finish_reason {res.finish_reason} without output"
    elif not res.event_times:  # usage counts tokens that form no text (a random model's ids past a byte
        res.ok = True          # vocabulary): completed, but the client saw no token arrive, so no TTFT/ITL
    else:
        res.ok = True


async def send(session: aiohttp.ClientSession, target: Target, payload: list[dict[str, str]] | str,
               max_tokens: int, res: RequestResult, clock0: float) -> RequestResult:
    """Send one request and fill ``res`` (never raises for a failed request; cancellation propagates)."""
    t0 = time.perf_counter()
    res.start = t0 - clock0
    try:
        async with asyncio.timeout(target.timeout_s):
            async with session.post(target.url, json=target.body(payload, max_tokens), headers=target.headers()) as r:
                res.status = r.status
                if r.status != 200:
                    body = await r.text()
                    try:
                        detail = _error_text(json.loads(body))
                    except (json.JSONDecodeError, AttributeError):
                        detail = body
                    res.error, res.detail = f"http_{r.status}", detail[:300]
                else:
                    await _read_stream(r, res, t0, target.api == "chat", target.logprobs)
    except TimeoutError:
        res.error, res.detail = "timeout", f"no complete answer within {target.timeout_s:g} s"
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        res.error, res.detail = "connection", f"{type(e).__name__}: {e}"[:300]
    except aiohttp.ClientError as e:
        res.error, res.detail = "bad_response", f"{type(e).__name__}: {e}"[:300]
    res.e2e = time.perf_counter() - t0
    return res
