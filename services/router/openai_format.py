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

    def _alternatives(self, d: TextDelta) -> list[list[tuple[str, float]]]:
        """Per position, the engine's top-k (text, logprob), most likely first, cut to what was asked."""
        k = self.req.top_logprobs
        tops = list(d.top_logprobs) + [None] * (len(d.token_ids) - len(d.top_logprobs))
        return [[] if t is None else [(self.pipeline.token_text(i), lp) for i, lp in
                                      zip(t.token_ids[:k], t.logprobs[:k], strict=True)] for t in tops]

    def _logprobs(self, d: TextDelta) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        tokens = [self.pipeline.token_text(t) for t in d.token_ids]
        lps = list(d.logprobs) + [None] * (len(tokens) - len(d.logprobs))
        alts = self._alternatives(d) if self.req.top_logprobs else [[] for _ in tokens]
        if self.req.chat:  # exactly top_logprobs alternatives per position
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode())} for a, alp in alt]}
                for s, lp, alt in zip(tokens, lps, alts, strict=True)]}
        offsets = []
        for s in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(s)
        top: list[dict[str, float | None]] | None = None
        if self.req.top_logprobs:
            # Legacy completions: the sampled token is always listed, so up to logprobs + 1 entries.
            top = []
            for s, lp, alt in zip(tokens, lps, alts, strict=True):
                entry: dict[str, float | None] = {}
                for a, alp in (*alt, (s, lp)):  # two ids with the same text: the likelier one stays
                    entry.setdefault(a, alp)
                top.append(entry)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}

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
