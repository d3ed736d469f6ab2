"""Asyncio front of the engine: the step loop runs in its own thread (STYLE rule 8).

Everything that touches the scheduler, block manager or KV tensors runs on the engine thread:
callers submit closures with :meth:`AsyncEngine.call` and await their result. Outputs travel back
to per-request asyncio queues through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.model_loader import LoadedModel
from services.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 engine: LLMEngine | None = None) -> None:
        self.engine = engine or LLMEngine(config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._dead: BaseException | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._loop, name="pdserve-engine", daemon=True)
        self._thread.start()

    # --- engine thread ---

    def _loop(self) -> None:
        eng = self.engine
        while not self._stopping:
            try:
                while True:
                    try:
                        fn, fut = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    if fut.set_running_or_notify_cancel():
                        try:
                            fut.set_result(fn())
                        except BaseException as e:  # delivered to the caller
                            fut.set_exception(e)
                if eng.has_work():
                    self._deliver(eng.step())
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
            except BaseException as e:
                log.exception("engine loop died")
                self._dead = e
                for loop, q in list(self._streams.values()):
                    loop.call_soon_threadsafe(q.put_nowait, e)
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            target = self._streams.get(o.request_id)
            if target is not None:
                loop, q = target
                loop.call_soon_threadsafe(q.put_nowait, o)

    # --- caller side ---

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread between steps and return its result."""
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((lambda: fn(*args), fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; aborts it if the consumer goes away."""
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine loop died: {item!r}")
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished and self._dead is None and not self._stopping:
                await asyncio.shield(self.call(self.engine.abort, request_id))  # consumer left: free it

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, detokenize: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's tokens. Raises InvalidRequestError before the first yield on bad input.

        ``detokenize=False``: token ids only (the caller does text and stop strings, as the router does)."""
        rid = request_id or uuid.uuid4().hex
        q = self.open_stream(rid)
        try:
            await self.call(self.engine.add_request, rid, prompt_token_ids, params, detokenize)
        except BaseException:
            self.close_stream(rid)
            raise
        async for out in self.stream(rid, q):
            yield out

    def _abort_now(self, request_id: str) -> bool:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver([out])
        return out is not None

    async def abort(self, request_id: str) -> bool:
        """Cancel a request; an open stream of it ends with an ABORT output."""
        return await self.call(self._abort_now, request_id)

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      detokenize: bool) -> tuple[asyncio.Queue, int, list[int]]:
        """Decode side: reserve blocks for imported KV and open the request's output stream.

        Returns (stream queue, leading blocks already cached, the request's block table)."""
        q = self.open_stream(request_id)

        def add() -> tuple[int, list[int]]:
            seq, num_cached = self.engine.add_kv_import(request_id, prompt_token_ids, params, detokenize)
            return num_cached, list(seq.block_table)

        try:
            num_cached, table = await self.call(add)
        except BaseException:
            self.close_stream(request_id)
            raise
        return q, num_cached, table

    async def kv_import_done(self, request_id: str, first_token: int, logprob: float | None) -> None:
        """Decode side: every page landed; the request joins the running batch."""

        def done() -> None:
            self._deliver(self.engine.kv_import_done(request_id, first_token, logprob))

        await self.call(done)

    async def stats(self) -> dict[str, float]:
        return await self.call(self.engine.stats)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        self.engine.runner.release()
