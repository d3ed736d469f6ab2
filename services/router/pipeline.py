"""The router's text pipeline: prompt -> token ids -> backend -> incremental text with stop strings.

Shared by the OpenAI HTTP API and the router's gRPC ``Generate``. The backend (the router's
dispatch core, or :class:`services.router.local_backend.LocalEngineBackend` in one process) deals in
token ids only; this module owns tokenization, the chat template, detokenization and stop strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.detokenizer import IncrementalDetokenizer, StopChecker
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")

BACKEND_ERROR_CODES = ("invalid_argument", "unavailable", "resource_exhausted", "internal", "not_found")


class BackendError(Exception):
    """A generation backend failed a request. ``code`` is one of :data:`BACKEND_ERROR_CODES`
    (the gRPC status names, lower case); the HTTP layer maps them to 400/503/429/500/404.
    ``param`` optionally names the request field at fault (invalid_argument)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        if code not in BACKEND_ERROR_CODES:
            raise ValueError(f"BackendError code must be one of {BACKEND_ERROR_CODES}, got {code!r}")
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.param = param


@dataclass
class TokenEvent:
    """One streamed step from the backend: token ids (and logprobs) new since the previous event."""

    token_ids: list[int]
    logprobs: list[float | None]
    finish_reason: str | None = None
    """"stop" | "length" | "abort", set on the last event only."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens whose KV was reused rather than computed."""


class GenerationBackend(Protocol):
    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                 ) -> AsyncIterator[TokenEvent]:
        """Stream token events until one carries a finish_reason. Raises BackendError."""
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
    finish_reason: str | None = None
    usage: Usage | None = None


class TextPipeline:
    def __init__(self, tokenizer: Tokenizer, backend: GenerationBackend, max_model_len: int) -> None:
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.tokenizer = tokenizer
        self.backend = backend
        self.max_model_len = max_model_len
        self._eos_ids = frozenset(tokenizer.eos_token_ids)

    def model_name(self) -> str:
        return self.backend.model_name()

    # --- prompts ---

    def encode_text(self, text: str) -> list[int]:
        """Plain-text prompt: special tokens (BOS) as the tokenizer adds them by default."""
        return list(self.tokenizer.encode(text))

    def encode_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render the chat template; the template writes the special tokens itself."""
        if not messages:
            raise InvalidRequestError("messages", "must contain at least one message")
        try:
            rendered = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt)
        except Exception as e:  # template errors (jinja raise_exception) are the client's input
            raise InvalidRequestError("messages", f"the chat template rejected them: {e}") from e
        return list(self.tokenizer.encode(rendered, add_special_tokens=False))

    def check(self, prompt_ids: list[int], params: SamplingParams, *, max_tokens: int | None = None,
              prompt_field: str = "prompt") -> SamplingParams:
        """Validate a prompt against the context and fill params.max_tokens.

        ``max_tokens=None`` means "as many as the context allows". Raises InvalidRequestError."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError(prompt_field, "the prompt is empty (0 tokens)")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                prompt_field, f"the prompt has {n} tokens but the model's context is {self.max_model_len} "
                              f"tokens (at most {self.max_model_len - 1} prompt tokens leave room for one output token)")
        if max_tokens is None:
            params.max_tokens = self.max_model_len - n
        else:
            params.max_tokens = max_tokens
            params.validate()
            if n + max_tokens > self.max_model_len:
                raise InvalidRequestError(
                    "max_tokens", f"the prompt has {n} tokens and max_tokens is {max_tokens}: {n + max_tokens} "
                                  f"tokens exceed the model's context of {self.max_model_len} tokens")
        return params.validate()

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (for logprobs' ``token`` fields)."""
        return self.tokenizer.decode([token_id])

    # --- generation ---

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TextDelta]:
        """Stream text deltas; the last one carries finish_reason and usage.

        Closing this generator early (client gone, task cancelled) aborts the backend request.
        ``params`` should already have gone through :meth:`check`."""
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        stop = StopChecker(list(params.stop)) if params.stop else None
        end_ids = self._eos_ids | frozenset(params.stop_token_ids)
        usage = Usage(prompt_tokens=len(prompt_ids))
        finished = False
        events = self.backend.generate(request_id, prompt_ids, params)
        try:
            async with contextlib.aclosing(events):  # type: ignore[type-var]
                async for ev in events:
                    usage.prompt_tokens = ev.prompt_tokens or usage.prompt_tokens
                    usage.cached_tokens = ev.cached_tokens or usage.cached_tokens
                    usage.completion_tokens += len(ev.token_ids)
                    reason = ev.finish_reason
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
                        yield TextDelta(text, list(ev.token_ids), list(ev.logprobs), reason, usage)
                        return
                    if text or ev.token_ids:
                        yield TextDelta(text, list(ev.token_ids), list(ev.logprobs))
            finished = True
            raise BackendError("internal", f"request {request_id}: the backend ended the stream without a "
                                           "finish reason")
        finally:
            if not finished:
                await _abort_quietly(self.backend, request_id)


async def _abort_quietly(backend: GenerationBackend, request_id: str) -> None:
    """Abort on the way out of a closed/cancelled stream; never raises (we may be in a finally)."""
    try:
        await asyncio.shield(backend.abort(request_id))
    except (asyncio.CancelledError, Exception) as e:
        log.warning("abort of %s failed: %r", request_id, e)
