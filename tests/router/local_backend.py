"""A :class:`GenerationBackend` over an in-process :class:`AsyncEngine`: router tests run the text pipeline
over a real engine in one process. It lives with the tests because the router itself runs no model (and
imports no torch)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.sequence import FinishReason
from services.router.pipeline import BackendError, TokenEvent
from services.text.sampling_params import InvalidRequestError, SamplingParams

_COMPLETED = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


class LocalEngineBackend:
    def __init__(self, engine: AsyncEngine, model_name: str | None = None) -> None:
        self.engine = engine
        self._model_name = model_name or engine.engine.loaded.model_id

    def model_name(self) -> str:
        return self._model_name

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None) -> AsyncIterator[TokenEvent]:
        """``deadline`` is enforced by the pipeline; this engine runs in the caller's process."""
        stream = self.engine.generate(prompt_ids, params, request_id, detokenize=False)
        try:
            async with contextlib.aclosing(stream):  # closing it early aborts the request
                async for out in stream:
                    reason = None
                    if out.finished:
                        reason = _COMPLETED.get(out.finish_reason or FinishReason.STOP)
                        if reason is None:  # an engine-side abort is a failure, never an empty success
                            raise BackendError("unavailable", f"request {request_id}: the engine aborted it")
                    yield TokenEvent(
                        token_ids=list(out.new_token_ids), logprobs=list(out.new_logprobs),
                        top_logprobs=list(out.new_top_logprobs),
                        finish_reason=reason, prompt_tokens=out.num_prompt_tokens,
                        cached_tokens=out.num_cached_tokens)
        except InvalidRequestError as e:
            raise BackendError("invalid_argument", str(e), param=e.field) from e
        except EngineDeadError as e:
            raise BackendError("unavailable", str(e)) from e

    async def abort(self, request_id: str) -> None:
        try:
            await self.engine.abort(request_id)
        except EngineDeadError:
            pass  # nothing left to abort
