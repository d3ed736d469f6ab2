"""OpenAI request bodies -> validated domain requests. Every error names the offending field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from services.engine.sampling_params import SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16


class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


@dataclass
class GenerateRequest:
    """One completion or chat request, validated and ready for the pipeline."""

    chat: bool
    model: str | None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    """None: as many as the context allows."""
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def prompt_field(self) -> str:
        return "messages" if self.chat else "prompt"


# --- typed getters: each raises APIError(400) naming the field ---


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict[str, Any], name: str, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise invalid(name, f"must be an integer, got {v!r}")
    return v


def _float(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(name, f"must be a finite number, got {v!r}")
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be a boolean, got {v!r}")
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"must be a string or a list of strings, got {v!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _stop_token_ids(body: dict[str, Any]) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise invalid("stop_token_ids", f"must be a list of non-negative integers, got {v!r}")
    return v


def _reject_unsupported(body: dict[str, Any]) -> None:
    """Refuse features we would otherwise silently ignore (a client asking for them wants them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise invalid(name, "is not supported (only 0)")
    if body.get("logit_bias"):
        raise invalid("logit_bias", "is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise invalid("best_of", "only 1 is supported")
    if body.get("echo"):
        raise invalid("echo", "is not supported")
    if body.get("suffix"):
        raise invalid("suffix", "is not supported")
    if body.get("tools"):
        raise invalid("tools", "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise invalid("response_format", "only {'type': 'text'} is supported")


def _sampling(body: dict[str, Any], req: GenerateRequest) -> None:
    n = _int(body, "n", 1)
    if n != 1:
        raise invalid("n", f"only n=1 is supported, got {n}")
    _reject_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens") if req.chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None if req.chat else 16)
    name = "max_completion_tokens" if req.chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise invalid(name, f"must be > 0, got {max_tokens}")
    temperature = _float(body, "temperature", 1.0)
    if temperature < 0:
        raise invalid("temperature", f"must be >= 0, got {temperature}")
    top_p = _float(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _int(body, "top_k", 0)
    assert top_k is not None
    if top_k < -1:
        raise invalid("top_k", f"must be >= -1 (0 or -1 disables), got {top_k}")
    seed = _int(body, "seed")
    req.max_tokens = max_tokens
    req.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise invalid("stream_options", f"must be an object, got {opts!r}")
        if not req.stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        req.include_usage = _bool(opts, "include_usage")
    req.params = SamplingParams(
        max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=_stop(body), stop_token_ids=_stop_token_ids(body), ignore_eos=_bool(body, "ignore_eos"),
        logprobs=req.logprobs,
    )


def _message(i: int, m: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, f"must be an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role is None:
        raise invalid(f"{where}.role", "is required")
    if role not in CHAT_ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    if "content" not in m:
        raise invalid(f"{where}.content", "is required")
    content = m["content"]
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise invalid(f"{where}.content[{j}]", "only text parts ({'type': 'text', 'text': ...}) are supported")
            parts.append(p["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content", f"must be a string or a list of text parts, got {content!r}")
    return {"role": role, "content": content}


def _prompt(body: dict[str, Any], req: GenerateRequest) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("prompt", "is required")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        req.prompt_text = p
    elif isinstance(p, list) and all(_is_int(t) for t in p):
        if any(t < 0 for t in p):
            raise invalid("prompt", "token ids must be non-negative")
        req.prompt_ids = list(p)
    elif isinstance(p, list) and all(isinstance(x, (str, list)) for x in p):
        raise invalid("prompt", f"got {len(p)} prompts; send one prompt per request (batched prompts are "
                                "not supported)")
    else:
        raise invalid("prompt", "must be a string, a list of token ids, or a list holding one of those")


def parse_request(body: Any, *, chat: bool) -> GenerateRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("model", f"must be a string, got {model!r}")
    req = GenerateRequest(chat=chat, model=model)
    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise invalid("messages", "is required")
        if not isinstance(msgs, list):
            raise invalid("messages", f"must be a list of messages, got {type(msgs).__name__}")
        if not msgs:
            raise invalid("messages", "must contain at least one message")
        req.messages = [_message(i, m) for i, m in enumerate(msgs)]
        req.logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0)
        assert top is not None
        if not 0 <= top <= 20:
            raise invalid("top_logprobs", f"must be in [0, 20], got {top}")
        if top and not req.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        req.top_logprobs = top
    else:
        _prompt(body, req)
        lp = _int(body, "logprobs")
        if lp is not None and not 0 <= lp <= 5:
            raise invalid("logprobs", f"must be in [0, 5], got {lp}")
        req.logprobs = lp is not None
        req.top_logprobs = lp or 0
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user", f"must be a string, got {user!r}")
    _sampling(body, req)
    return req
