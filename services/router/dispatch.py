"""The router's dispatch core: one request to a decode and a prefill (or a colocated worker), with migration.

P/D mode runs :class:`services.router.handoff.Handoff` attempts; colocated mode (no prefill
instances) sends the prompt to a worker that does both phases.

Migration: when the decode or worker serving a stream dies mid-generation, the
request is dispatched again to another one with prompt = original prompt + the tokens already sent
to the client and max_tokens reduced by their count. The re-prefill's first token is the next token,
so the client's stream continues with no duplicate and no gap (greedy output equals an uninterrupted
run's; a sampled one continues from the same text). At most ``max_retries`` migrations per request;
none left, or no decode left: BackendError("unavailable") mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable

import grpc

from services.common import tracing
from services.common.block_hash import block_hashes
from services.common.metrics import RouterMetrics
from services.common.pb import decode_pb2
from services.router.handoff import Handoff, abort_quietly, exhausted, finish_of, pick, top_of
from services.router.instances import InstancePool, inflight
from services.router.pipeline import BackendError, TokenEvent
from services.router.request_state import DecodeLostError, DispatchSettings, RequestState, token_stream
from services.router.rpc_failure import RpcFailure
from services.text.sampling_params import SamplingParams
from services.text.sampling_pb import params_to_pb

__all__ = ["DisaggregatedBackend", "DispatchSettings"]

log = logging.getLogger(__name__)


class DisaggregatedBackend:
    def __init__(self, prefill: InstancePool | None, decode: InstancePool, settings: DispatchSettings,
                 metrics: RouterMetrics, model: str) -> None:
        self.prefill_pool = prefill
        self.decode_pool = decode
        self.s = settings
        self.metrics = metrics
        self.model = model
        self.active: dict[str, RequestState] = {}
        """Requests in flight, by the router's request id (for Abort)."""
        self._bg: set[asyncio.Task] = set()
        self.handoff = Handoff(prefill, decode, settings, metrics, self._spawn) if prefill is not None else None

    def model_name(self) -> str:
        return self.model

    def _spawn(self, coro: Awaitable[object]) -> None:
        task = asyncio.ensure_future(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def close(self) -> None:
        """Wait (briefly: each is bounded by its RPC timeout) for the aborts still being sent."""
        tasks = list(self._bg)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def abort(self, request_id: str) -> None:
        st = self.active.get(request_id)
        if st is not None and st.target is not None:
            inst, key = st.target
            await abort_quietly(inst, key, "client")

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None) -> AsyncIterator[TokenEvent]:
        st = RequestState(request_id, deadline if deadline is not None else time.time() + self.s.timeout_s,
                          tuple(tracing.inject_metadata()))
        self.active[request_id] = st
        emitted: list[int] = []
        cached = 0  # the first attempt's count (a migration re-prefills prompt + tokens: not the request's)
        migrating = False  # a migration is under way: its outcome is counted at the next event or failure
        try:
            while True:
                left = params.max_tokens - len(emitted)
                if left <= 0:  # the last token was sent but its finish was lost with the decode
                    yield TokenEvent([], [], finish_reason="length", prompt_tokens=len(prompt_ids))
                    return
                attempt_params = dataclasses.replace(params, max_tokens=left) if emitted else params
                attempt = self._attempt(st, prompt_ids + emitted, attempt_params)
                fresh = not emitted
                try:
                    async with contextlib.aclosing(attempt):
                        async for ev in attempt:
                            if migrating:
                                self.metrics.migrations_total.labels("ok").inc()
                                migrating = False
                            if fresh and ev.cached_tokens:  # prefill's count may come after decode's first tokens
                                cached = ev.cached_tokens
                            emitted += ev.token_ids
                            yield dataclasses.replace(ev, prompt_tokens=len(prompt_ids), cached_tokens=cached)
                            if ev.finish_reason is not None:
                                return
                    raise BackendError("internal", f"request {request_id}: dispatch ended without a finish reason")
                except DecodeLostError as e:
                    st.lost.add(e.address)
                    if not emitted:  # nothing sent yet: a plain retry on another decode
                        self.metrics.dispatch_retries_total.labels(self._decode_role(), "lost").inc()
                        log.warning("request %s: decode %s lost before its first token (%s); retrying",
                                    request_id, e.address, e.why)
                        continue
                    was_migrating, migrating = migrating, False
                    if was_migrating:  # the re-dispatched stream died before it sent anything
                        self.metrics.migrations_total.labels("failed").inc()
                    if st.migrations >= self.s.max_retries:
                        if not was_migrating:
                            self.metrics.migrations_total.labels("failed").inc()
                        raise BackendError("unavailable", f"request {request_id}: decode {e.address} died "
                                                          f"mid-stream ({e.why}) and {st.migrations} "
                                                          "migrations were used up") from e
                    st.migrations += 1
                    migrating = True
                    log.warning("request %s: decode %s died after %d tokens (%s); migrating", request_id,
                                e.address, len(emitted), e.why)
                except BackendError:
                    if migrating:
                        self.metrics.migrations_total.labels("failed").inc()
                    raise
        finally:
            self.active.pop(request_id, None)

    def _decode_role(self) -> str:
        return "decode" if self.prefill_pool is not None else "worker"

    def _attempt(self, st: RequestState, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenEvent]:
        if self.handoff is not None:
            return self.handoff.attempt(st, prompt, params)
        return self._colocated(st, prompt, params)

    async def _colocated(self, st: RequestState, prompt: list[int], params: SamplingParams
                         ) -> AsyncIterator[TokenEvent]:
        """Colocated mode: a worker computes prefill and decode. A full or unreachable worker is skipped
        before its first token; one that dies after it raises DecodeLostError (migrate)."""
        hashes = block_hashes(prompt, self.s.block_size)
        tried = set(st.lost)
        last: RpcFailure | None = None
        for _ in range(self.s.max_retries + 1):
            worker = await pick(self.decode_pool, self.s, hashes, tried, last, st, self.metrics)
            st.target = (worker, st.request_id)
            started = finished = False
            try:
                with inflight(worker):
                    req = decode_pb2.DecodeGenerateRequest(request_id=st.request_id, token_ids=prompt,
                                                           params=params_to_pb(params))
                    async with token_stream(worker, req, self.s, metadata=st.metadata,
                                            timeout_s=st.timeout_s()) as call:
                        async for msg in call:
                            if not started:
                                started = True
                                worker.remember(hashes)
                            reason = finish_of(msg, f"worker {worker.address}")
                            finished = reason is not None  # before the yield: the consumer may close us there
                            yield TokenEvent(list(msg.token_ids), list(msg.logprobs) or [None] * len(msg.token_ids),
                                             finish_reason=reason, prompt_tokens=len(prompt),
                                             cached_tokens=msg.usage.cached_tokens,
                                             top_logprobs=[top_of(t) for t in msg.top_logprobs])
                            if finished:
                                return
                raise BackendError("internal", f"worker {worker.address} ended the stream without a finish reason")
            except grpc.aio.AioRpcError as e:
                last = RpcFailure.of(f"worker {worker.address} Generate", e)
                last.note(self.decode_pool, worker)
                if started and last.instance_lost:
                    raise DecodeLostError(worker.address, f"{e.code().name} {e.details()}") from e
                if started or not last.retryable:
                    raise last.error() from e
                self.metrics.dispatch_retries_total.labels("worker", last.label).inc()
                tried.add(worker.address)
            finally:
                st.target = None
                if not finished:
                    self._spawn(abort_quietly(worker, st.request_id, "router"))
        raise exhausted("worker", last, f"{self.s.max_retries + 1} workers failed")
