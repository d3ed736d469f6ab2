"""A :class:`GenerationBackend` over an in-process :class:`AsyncEngine` (tests, single-process dev mode)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from services.engine.async_engine import AsyncEngine, EngineDeadError
from services.engine.sampling_params import InvalidRequestError, SamplingParams
from services.router.pipeline import BackendError, TokenEvent


class LocalEngineBackend:
    def __init__(self, engine: AsyncEngine, model_name: str | None = None) -> None:
        self.engine = engine
        self._model_name = model_name or engine.engine.loaded.model_id

    def model_name(self) -> str:
        return self._model_name

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams
                       ) -> AsyncIterator[TokenEvent]:
        stream = self.engine.generate(prompt_ids, params, request_id, detokenize=False)
        try:
            async with contextlib.aclosing(stream):  # closing it early aborts the request
                async for out in stream:
                    reason = (out.finish_reason.value if out.finish_reason else "stop") if out.finished else None
                    yield TokenEvent(
                        token_ids=list(out.new_token_ids), logprobs=list(out.new_logprobs),
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
