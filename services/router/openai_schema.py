"""OpenAI request bodies -> validated domain requests. Every error names the offending field.

Hostile bodies answer 400, never 500: JSON nested deeper than :data:`MAX_JSON_DEPTH`, strings holding
lone surrogates (``"\\ud800"``: valid JSON, not encodable text), integers outside what the wire
(protobuf int32/int64) and the engine can hold, and values of the wrong type anywhere.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from services.text.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays/objects a body may have (a chat body needs 4)."""
INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(eq=False, repr=False)  # an exception: hashable, repr as raised
class APIError(Exception):
    """An error answered as OpenAI does: ``{"error": {"message", "type", "param", "code"}}``."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    type: str = "invalid_request_error"
    headers: dict[str, str] = field(default_factory=dict)
    """Extra response headers (Retry-After, WWW-Authenticate)."""

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


INVALID_VALUE, INVALID_TYPE, MISSING = "invalid_value", "invalid_type", "missing_required_parameter"
"""OpenAI's ``error.code`` for a field out of range, a field of the wrong JSON type, a required field absent."""
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's ``error.code`` for a prompt (plus max_tokens) longer than the context."""
TEMPERATURE_MAX = 2.0
"""OpenAI's temperature range is [0, 2]."""


def invalid(param: str, message: str, code: str | None = INVALID_VALUE) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def wrong_type(param: str, message: str) -> APIError:
    return invalid(param, message, code=INVALID_TYPE)


def missing(param: str) -> APIError:
    return invalid(param, "is required", code=MISSING)


def load_json(raw: bytes) -> Any:
    """Parse a request body; APIError(400) for anything that is not JSON we can safely walk."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError; integers past int_max_str_digits
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    _check_tree(body)
    return body


def _check_tree(body: Any) -> None:
    """Depth and text check of a parsed body, iteratively (no recursion to exhaust). The error names
    the top-level field that holds the fault."""
    stack: list[tuple[Any, int, str | None]] = [(body, 1, None)]
    while stack:
        node, depth, top = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                raise APIError(400, f"{top or 'body'}: contains a lone UTF-16 surrogate (not valid Unicode text)",
                               param=top, code="invalid_text")
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"{top or 'body'}: nests deeper than {MAX_JSON_DEPTH} levels", param=top,
                           code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                field_name = k if top is None else top
                if _SURROGATE.search(k):
                    raise APIError(400, "a key contains a lone UTF-16 surrogate (not valid Unicode text)",
                                   param=top, code="invalid_text")
                stack.append((v, depth + 1, field_name))
        else:
            stack.extend((v, depth + 1, top) for v in node)


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


def _int(body: dict[str, Any], name: str, default: int | None = None, *, lo: int = INT64_MIN,
         hi: int = INT64_MAX, param: str | None = None) -> int | None:
    """An integer field in [lo, hi] (default: int64, what protobuf carries)."""
    v = body.get(name)
    param = param or name
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise wrong_type(param, f"must be an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise invalid(param, f"must be in [{lo}, {hi}], got {_show(v)}")
    return v


def _show(v: Any) -> str:
    """A value for an error message, bounded in length (bodies can be megabytes)."""
    text = repr(v)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _float(body: dict[str, Any], name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise wrong_type(name, f"must be a finite number, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:  # an integer past float range
        raise invalid(name, f"must be a finite number, got {_show(v)}") from None
    if not math.isfinite(f):
        raise invalid(name, f"must be a finite number, got {_show(v)}")
    return f


def _bool(body: dict[str, Any], name: str, default: bool = False, *, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise wrong_type(param or name, f"must be a boolean, got {_show(v)}")
    return v


def _stop(body: dict[str, Any]) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise wrong_type("stop", f"must be a string or a list of strings, got {_show(v)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _stop_token_ids(body: dict[str, Any]) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and 0 <= t <= INT32_MAX for t in v):
        raise invalid("stop_token_ids", f"must be a list of token ids (integers in [0, {INT32_MAX}]), "
                                        f"got {_show(v)}")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(v)}")
    return v


UNSUPPORTED_PARAMS: dict[str, tuple[str, str]] = {
    "n": ("n=1", "one choice per request: send n requests (a shared prompt is prefix-cached)"),
    "best_of": ("best_of=1", "needs several candidates per request, as n does"),
    "presence_penalty": ("0", "the sampler applies no penalties"),
    "frequency_penalty": ("0", "the sampler applies no penalties"),
    "logit_bias": ("an empty map", "the sampler does not bias logits"),
    "echo": ("false", "the prompt is not returned in the output"),
    "suffix": ("an empty string", "no fill-in-the-middle"),
    "tools": ("an empty list or tool_choice 'none' (the tools are then ignored)", "no tool calling"),
    "tool_choice": ("'none'", "no tool calling"),
    "functions": ("an empty list", "no function calling"),
    "function_call": ("'none'", "no function calling"),
    "response_format": ("{'type': 'text'}", "no constrained (JSON / schema) decoding"),
    "modalities": ("['text']", "text output only"),
    "audio": ("null", "text output only"),
    "prediction": ("null", "no predicted outputs"),
}
"""Request fields answered with HTTP 400 (``param``: the field, ``code``: unsupported_parameter) unless
they hold the one accepted value: (accepted value, why). A client that asks for a feature wants it, so
none is silently ignored. docs/API.md lists the same table."""


def _unsupported(name: str) -> APIError:
    accepted, why = UNSUPPORTED_PARAMS[name]
    return invalid(name, f"is not supported other than {accepted} ({why})", code="unsupported_parameter")


def _reject_unsupported(body: dict[str, Any]) -> None:
    """Refuse features we would otherwise silently ignore (a client asking for them wants them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is not None and v != 0:
            raise _unsupported(name)
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise _unsupported("best_of")
    for name in ("logit_bias", "echo", "suffix", "functions"):
        if body.get(name):
            raise _unsupported(name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise _unsupported(name)
    # tool_choice "none" forbids calling any tool: the tools are then only a description the model may
    # ignore, so they are (OpenAI's default with tools is "auto", which needs tool calling).
    if body.get("tools") and body.get("tool_choice") != "none":
        raise _unsupported("tools")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise _unsupported("response_format")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise _unsupported("modalities")
    for name in ("audio", "prediction"):
        if body.get(name) is not None:
            raise _unsupported(name)


def _sampling(body: dict[str, Any], req: GenerateRequest) -> None:
    n = _int(body, "n", 1, lo=1, hi=INT32_MAX)
    if n != 1:
        raise _unsupported("n")
    _reject_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens") if req.chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None if req.chat else 16)
    name = "max_completion_tokens" if req.chat and body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and max_tokens <= 0:
        raise invalid(name, f"must be > 0, got {max_tokens}")
    temperature = _float(body, "temperature", 1.0)
    if not 0 <= temperature <= TEMPERATURE_MAX:
        raise invalid("temperature", f"must be in [0, {TEMPERATURE_MAX:g}], got {temperature:g}")
    top_p = _float(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _int(body, "top_k", 0, lo=-1, hi=INT32_MAX)  # -1 or 0 disables
    assert top_k is not None
    seed = _int(body, "seed")
    req.max_tokens = max_tokens
    req.stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise wrong_type("stream_options", f"must be an object, got {_show(opts)}")
        if not req.stream:
            raise invalid("stream_options", "is only allowed when stream is true")
        req.include_usage = _bool(opts, "include_usage", param="stream_options.include_usage")
    req.params = SamplingParams(
        max_tokens=max_tokens or 1, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=_stop(body), stop_token_ids=_stop_token_ids(body), ignore_eos=_bool(body, "ignore_eos"),
        logprobs=req.logprobs, top_logprobs=req.top_logprobs,
    )


def _message(i: int, m: Any) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise wrong_type(where, f"must be an object with role and content, got {type(m).__name__}")
    role = m.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}")
    if "content" not in m:
        raise missing(f"{where}.content")
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
        raise wrong_type(f"{where}.content", f"must be a string or a list of text parts, got {_show(content)}")
    return {"role": role, "content": content}


def _prompt(body: dict[str, Any], req: GenerateRequest) -> None:
    if "prompt" not in body or body["prompt"] is None:
        raise missing("prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise invalid("prompt", f"got {len(p)} prompts; send one prompt per request (batched prompts are "
                                "not supported)")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        req.prompt_text = p
    elif isinstance(p, list) and all(_is_int(t) for t in p):
        if any(not 0 <= t <= INT32_MAX for t in p):
            raise invalid("prompt", f"token ids must be non-negative integers up to {INT32_MAX}")
        req.prompt_ids = list(p)
    else:
        raise wrong_type("prompt", "must be a string, a list of token ids, or a list holding one of those")


def parse_request(body: Any, *, chat: bool) -> GenerateRequest:
    """Validate a /v1/completions (``chat=False``) or /v1/chat/completions body."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code=INVALID_TYPE)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise wrong_type("model", f"must be a string, got {_show(model)}")
    req = GenerateRequest(chat=chat, model=model)
    if chat:
        msgs = body.get("messages")
        if msgs is None:
            raise missing("messages")
        if not isinstance(msgs, list):
            raise wrong_type("messages", f"must be a list of messages, got {type(msgs).__name__}")
        if not msgs:
            raise invalid("messages", "must contain at least one message")
        req.messages = [_message(i, m) for i, m in enumerate(msgs)]
        req.logprobs = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS)
        assert top is not None
        if top and not req.logprobs:
            raise invalid("top_logprobs", "requires logprobs to be true")
        req.top_logprobs = top
    else:
        _prompt(body, req)
        lp = _int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        req.logprobs = lp is not None
        req.top_logprobs = lp or 0
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise wrong_type("user", f"must be a string, got {_show(user)}")
    _sampling(body, req)
    if model is None:  # checked last: a body with other faults is told about those first
        raise missing("model")
    return req
