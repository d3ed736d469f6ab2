"""The router's text pipeline: prompt -> token ids -> backend -> incremental text with stop strings.

Shared by the OpenAI HTTP API and the router's gRPC ``Generate``. The backend (the router's
dispatch core, or :class:`tests.router.local_backend.LocalEngineBackend` in one process) deals in
token ids only; this module owns tokenization, the chat template, detokenization and stop strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.router.openai_schema import CONTEXT_LENGTH_EXCEEDED
from services.text.detokenizer import IncrementalDetokenizer, StopChecker
from services.text.sampling_params import InvalidRequestError, SamplingParams, TopLogprobs
from services.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")
"""What a client ever sees as finish_reason (OpenAI's values). A backend may also end a stream with
"abort" (:class:`TokenEvent`); the pipeline turns that into a :class:`BackendError`."""

BACKEND_ERROR_CODES = ("invalid_argument", "unavailable", "resource_exhausted", "internal", "not_found",
                       "deadline_exceeded")

DEFAULT_RETRY_AFTER_S = 1.0
"""Retry-After advised with resource_exhausted / unavailable when the source names none (seconds)."""

MAX_CHARS_PER_TOKEN = 16
"""Prompts longer than this many characters per token of context are refused before tokenization
(tokenizing megabytes only to refuse them costs seconds of CPU); real text averages ~4."""


class BackendError(Exception):
    """A generation backend failed a request. ``code`` is one of :data:`BACKEND_ERROR_CODES`
    (the gRPC status names, lower case); the HTTP layer maps them to 400/503/429/500/404/504.
    ``param`` optionally names the request field at fault (invalid_argument). ``retry_after_s``
    (seconds) is the wait a client should take before retrying (resource_exhausted, unavailable);
    None lets the API layer use :data:`DEFAULT_RETRY_AFTER_S`."""

    def __init__(self, code: str, message: str, param: str | None = None, *,
                 retry_after_s: float | None = None) -> None:
        if code not in BACKEND_ERROR_CODES:
            raise ValueError(f"BackendError code must be one of {BACKEND_ERROR_CODES}, got {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        return self.code in ("resource_exhausted", "unavailable")


@dataclass
class TokenEvent:
    """One streamed step from the backend: token ids (and logprobs) new since the previous event."""

    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None = None
    """"stop" | "length" | "abort", set on the last event only ("abort": the backend gave up on the
    request, e.g. its reservation expired; never shown to a client)."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV was reused rather than computed."""
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    """Alternatives at each of token_ids when params.top_logprobs > 0 (may be shorter: None)."""


class GenerationBackend(Protocol):
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                 deadline: float | None = None) -> AsyncIterator[TokenEvent]:
        """Stream token events until one carries a finish_reason. Raises BackendError.

        ``deadline`` (Unix seconds, None: none) is when the client stops waiting: work for the
        request past it is wasted, so a backend may drop it and derive leases from it. The pipeline
        enforces it on its own side whatever the backend does."""
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel a request wherever it is; a no-op for unknown or finished ones."""
        ...

    def model_name(self) -> str: ...


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class TextDelta:
    """New text and tokens since the previous delta. The last delta has finish_reason and usage."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[TopLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    """One of :data:`FINISH_REASONS`, on the last delta only."""
    usage: Usage | None = None


class TextPipeline:
    def __init__(self, tokenizer: Tokenizer, backend: GenerationBackend, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.backend = backend
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len * MAX_CHARS_PER_TOKEN
        self._eos_ids = frozenset(tokenizer.eos_token_ids)

    def model_name(self) -> str:
        return self.backend.model_name()

    # --- prompts ---

    def _check_chars(self, n_chars: int, field_name: str) -> None:
        if n_chars > self.max_prompt_chars:
            raise InvalidRequestError(
                field_name, f"the prompt has {n_chars} characters; at most {self.max_prompt_chars} are accepted "
                            f"({MAX_CHARS_PER_TOKEN} per token of the model's {self.max_model_len}-token context)",
                code=CONTEXT_LENGTH_EXCEEDED)

    def encode_text(self, text: str, field_name: str = "prompt") -> list[int]:
        """Plain-text prompt: special tokens (BOS) as the tokenizer adds them by default."""
        self._check_chars(len(text), field_name)
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template; the template writes the special tokens itself."""
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        self._check_chars(sum(len(m.get("content", "")) + len(m.get("role", "")) for m in messages), "messages")
        try:
            rendered = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
        except Exception as e:  # template errors (jinja raise_exception) are the client's input
            raise InvalidRequestError("messages", f"the chat template rejected them: {e}") from e
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def check(self, prompt_ids: list[int], params: SamplingParams, *, max_tokens: int | None = None,
              prompt_field: str = "prompt") -> SamplingParams:
        """Validate a prompt against the context and vocabulary and fill params.max_tokens.

        ``max_tokens=None`` means "as many as the context allows". Raises InvalidRequestError."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError(prompt_field, "the prompt is empty (0 tokens)")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                prompt_field, f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                              f"tokens (at most {self.max_model_len - 1} prompt tokens leave room for one output token)",
                code=CONTEXT_LENGTH_EXCEEDED)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(prompt_field, f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError("stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})")
        if max_tokens is None:
            params.max_tokens = self.max_model_len - n
        else:
            params.max_tokens = max_tokens
            params.validate()
            if n + max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    "max_tokens", f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                                  f"tokens exceed the model's context of {self.max_model_len} tokens",
                    code=CONTEXT_LENGTH_EXCEEDED)
        return params.validate()

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs' ``token`` fields)."""
        return self.tokenizer.decode([token_id])

    # --- generation ---

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None) -> AsyncIterator[TextDelta]:
        """Stream text deltas; the last one carries finish_reason ("stop" or "length") and usage.

        Every other ending raises BackendError: a backend that aborts the request or ends without a
        finish reason or without a single token, or ``deadline`` (Unix seconds) passing before the
        last delta ("deadline_exceeded"). Closing this generator early (client gone, task cancelled)
        or any failure aborts the backend request. ``params`` should already have gone through
        :meth:`check`."""
        if deadline is not None and deadline <= time.time():
            raise BackendError("deadline_exceeded", f"request {request_id}: its deadline passed before it started")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stop = StopChecker(list(params.stop)) if params.stop else None
        end_ids = self._eos_ids | frozenset(params.stop_token_ids)
        usage = Usage(prompt_tokens=len(prompt_ids))
        finished = False
        events = self.backend.generate(request_id, prompt_ids, params, deadline=deadline)
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                while True:
                    ev = await _next_event(events, request_id, deadline)
                    if ev is None:
                        break
                    usage.prompt_tokens = ev.prompt_tokens or usage.prompt_tokens
                    usage.cached_tokens = ev.cached_tokens or usage.cached_tokens
                    usage.completion_tokens += len(ev.token_ids)
                    reason = ev.finish_reason
                    if reason is not None and reason not in FINISH_REASONS:
                        raise _ended_badly(request_id, reason, deadline)
                    if reason is not None and usage.completion_tokens == 0:
                        raise BackendError("internal", f"request {request_id}: the backend finished ({reason}) "
                                                       "without generating a token")
                    text = ""
                    for i, t in enumerate(ev.token_ids):
                        last = i == len(ev.token_ids) - 1
                        if last and reason == "stop" and t in end_ids and not params.ignore_eos:
                            continue  # EOS / stop token ends the text; it is not part of it
                        text += detok.add(t)
                    if reason is not None:
                        text += detok.flush()
                    if stop is not None:
                        text = stop.feed(text)
                        if stop.stopped:
                            if reason is None:
                                await self.backend.abort(request_id)
                            reason = "stop"
                        elif reason is not None:
                            text += stop.flush()
                    if reason is not None:
                        finished = True
                        yield TextDelta(text, list(ev.token_ids), list(ev.logprobs), list(ev.top_logprobs),
                                        reason, usage)
                        return
                    if text or ev.token_ids:
                        yield TextDelta(text, list(ev.token_ids), list(ev.logprobs), list(ev.top_logprobs))
            raise BackendError("internal", f"request {request_id}: the backend ended the stream without a "
                                           "finish reason")
        finally:
            if not finished:
                await _abort_quietly(self.backend, request_id)


async def _next_event(events: AsyncIterator[TokenEvent], request_id: str, deadline: float | None
                      ) -> TokenEvent | None:
    """The backend's next event, None at its end; BackendError("deadline_exceeded") once ``deadline``
    (Unix seconds) passes while waiting."""
    if deadline is None:
        return await anext(events, None)
    loop = asyncio.get_running_loop()
    timeout = asyncio.timeout_at(loop.time() + (deadline - time.time()))
    try:
        async with timeout:
            return await anext(events, None)
    except TimeoutError:
        if not timeout.expired():
            raise
        raise BackendError("deadline_exceeded", f"request {request_id}: its deadline passed while generating "
                                                "(the client's timeout or the router's request_timeout_s)") from None


def _ended_badly(request_id: str, reason: str, deadline: float | None) -> BackendError:
    """A stream the backend ended without completing it ("abort", or a reason we do not know)."""
    if deadline is not None and time.time() >= deadline:
        return BackendError("deadline_exceeded", f"request {request_id}: the backend gave it up at its deadline")
    if reason == "abort":
        return BackendError("unavailable", f"request {request_id}: the backend aborted it before it completed",
                            retry_after_s=DEFAULT_RETRY_AFTER_S)
    return BackendError("internal", f"request {request_id}: the backend ended it with unknown finish reason "
                                    f"{reason!r}")


async def _abort_quietly(backend: GenerationBackend, request_id: str) -> None:
    """Abort on the way out of a closed/cancelled stream; never raises (we may be in a finally)."""
    try:
        await asyncio.shield(backend.abort(request_id))
    except (asyncio.CancelledError, Exception) as e:
        log.warning("abort of %s failed: %r", request_id, e)
