"""OpenAI response objects (completion, chat completion, their stream chunks) of one request."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from services.router.openai_schema import GenerateRequest
from services.router.pipeline import TextDelta, TextPipeline, Usage


class Formatter:
    """Builds the OpenAI response objects of one request."""

    def __init__(self, pipeline: TextPipeline, req: GenerateRequest, model: str) -> None:
        self.pipeline = pipeline
        self.req = req
        self.model = model
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._text_offset = 0

    @staticmethod
    def dumps(obj: dict[str, Any]) -> bytes:
        """One SSE payload: UTF-8 JSON (a lone surrogate, which no valid text holds, becomes '?')."""
        return json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace")

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
