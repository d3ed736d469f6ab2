"""Asyncio front of the engine: the step loop runs in a thread of its own (:class:`AsyncEngine`), or in an
engine-core process of its own (:class:`services.engine.core_client.EngineCoreClient`); both are an
:class:`EngineFront`, the one surface services drive an engine through.

Everything that touches the scheduler, block manager or KV tensors runs on the step loop's thread
(:class:`services.engine.step_loop.StepLoop`): :class:`AsyncEngine` callers may submit closures with :meth:`AsyncEngine.call`; the
typed operations every front has (add, reserve, kv_import_done, abort, import_payload) are what a service
uses. Outputs travel back
through ``loop.call_soon_threadsafe``, one call per step and event loop, to each request's route: its
own asyncio queue, or a :class:`StepSubscriber` that gets every output of its requests in a step as one
:class:`StepBatch` (one queue item per step, however many requests). Routes are resolved on the event
loop, so a request can move from its queue to a subscriber (:meth:`AsyncEngine.route_to`) without
losing or reordering an output.

The engine thread publishes a stats snapshot after every command, after every step and while idle
(every ``IDLE_WAIT_S``); :meth:`AsyncEngine.stats` answers from it at once, however long a step runs,
so health, load reports and admission never wait on the engine. If the loop dies, every pending
call and open stream fails with :class:`EngineDeadError` and the death callbacks run (the service
takes health NOT_SERVING and exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine, RequestOutput
from services.engine.errors import EngineDeadError
from services.engine.kv_pages import pages_of
from services.engine.model_loader import LoadedModel
from services.engine.step_loop import StepLoop, StepRecord
from services.text.sampling_params import SamplingParams, TopLogprobs

log = logging.getLogger(__name__)
T = TypeVar("T")

DeathCallback = Callable[[BaseException], None]


@dataclass(frozen=True, slots=True)
class StepBatch:
    """The outputs one engine step (or one command) produced for one subscriber's requests, in engine
    order: a request's outputs keep their order within and across batches. Plain data, no callbacks."""

    outputs: list[RequestOutput]


class StepSubscriber:
    """Where a group of requests' outputs go as one :class:`StepBatch` per step. ``queue`` also carries
    whatever typed events its owner puts there itself; an exception in it means the engine loop died."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()


Route = asyncio.Queue | StepSubscriber
"""Where a request's outputs go: its own queue (one item per output) or a subscriber (one per step)."""


class EngineFront:
    """What a service holds of its engine, wherever the step loop runs: the model's fixed facts, per-request
    routes (a request's own queue, or a :class:`StepSubscriber`), the typed operations, health.

    Routes are resolved on the event loop, so a request can move from its queue to a subscriber
    (:meth:`route_to`) without losing or reordering an output. Subclasses deliver outputs with
    :meth:`_put_all` on the event loop that owns the routes, and call :meth:`_die` once."""

    model_id: str
    layout: Any
    fp8_layout: Any
    vocab_size: int
    max_model_len: int
    ranks: Any = None
    device: str = "cpu"
    """The engine's --device (cpu, cuda, cuda:N): the service's device-dependent defaults follow it."""
    offered_pool: Any = None
    """The same-host pool (shm / CUDA IPC KVDestination) side transports may write into, or None."""
    in_process = True
    """Whether the step loop runs in this process (engine internals reachable); False for an engine core."""

    def __init__(self) -> None:
        self._dead: BaseException | None = None
        self._death_callbacks: list[DeathCallback] = []
        self._death_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Route]] = {}
        """Request id -> (its event loop, its route); the route is read and replaced on that loop only."""

    # --- delivery (event loop) ---

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        """Each output to its request's route as it is now (a request closed meanwhile drops it); one
        StepBatch per subscriber."""
        grouped: dict[int, tuple[StepSubscriber, list[RequestOutput]]] = {}
        streams = self._streams
        for o in outputs:
            target = streams.get(o.request_id)
            if target is None:
                continue
            route = target[1]
            if isinstance(route, StepSubscriber):
                entry = grouped.get(id(route))
                if entry is None:
                    grouped[id(route)] = (route, [o])
                else:
                    entry[1].append(o)
            else:
                route.put_nowait(o)
        for sub, outs in grouped.values():
            sub.queue.put_nowait(StepBatch(outs))

    def _die(self, e: BaseException, *, stopped: bool = False) -> None:
        """The loop died (any thread): every open stream gets ``e``, the death callbacks run once (not when
        the loop was ``stopped`` by the service's own shutdown)."""
        with self._death_lock:
            if self._dead is not None:
                return
            self._dead = e
            callbacks = [] if stopped else list(self._death_callbacks)
        targets = {id(route): (loop, route) for loop, route in list(self._streams.values())}
        for loop, route in targets.values():
            q = route.queue if isinstance(route, StepSubscriber) else route
            loop.call_soon_threadsafe(q.put_nowait, e)
        for cb in callbacks:
            try:
                cb(e)
            except Exception:
                log.exception("engine death callback failed")

    # --- health ---

    @property
    def dead(self) -> BaseException | None:
        """The exception that killed the engine loop, or None while it runs."""
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop died: {self._dead!r}")

    def add_death_callback(self, fn: DeathCallback) -> None:
        """Call ``fn(exc)`` once if the loop dies (on any thread; at once if it is already dead)."""
        with self._death_lock:
            if self._dead is None:
                self._death_callbacks.append(fn)
                return
        fn(self._dead)

    def published_stats(self) -> dict[str, float]:  # pragma: no cover - abstract
        raise NotImplementedError

    def take_steps(self) -> list[StepRecord]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def stats(self) -> dict[str, float]:
        """The published snapshot (see :meth:`published_stats`); answers at once."""
        return self.published_stats()

    # --- routes ---

    def open_stream(self, request_id: str) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if self._dead is not None:  # a stream opened after the loop died ends at once
            q.put_nowait(self._dead)
        return q

    def route_to(self, request_id: str, subscriber: StepSubscriber) -> None:
        """Send ``request_id``'s outputs to ``subscriber`` from now on (call on the subscriber's event loop).
        A request that had its own queue (a reservation opened by :meth:`reserve`) moves over: what its
        queue held goes to the subscriber first, as one batch. Raises EngineDeadError if the loop died."""
        self._check_alive()
        old = self._streams.get(request_id)
        self._streams[request_id] = (asyncio.get_running_loop(), subscriber)
        if old is None or not isinstance(old[1], asyncio.Queue):
            return
        held: list[RequestOutput] = []
        while not old[1].empty():
            item = old[1].get_nowait()
            if isinstance(item, BaseException):
                raise EngineDeadError(f"engine loop died: {item!r}")
            held.append(item)
        if held:
            subscriber.queue.put_nowait(StepBatch(held))

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def _stopping(self) -> bool:
        return False

    async def stream(self, request_id: str, q: asyncio.Queue, abort_on_exit: bool = True
                     ) -> AsyncIterator[RequestOutput]:
        """Yield a request's outputs until it finishes; aborts it if the consumer goes away (unless
        ``abort_on_exit`` is False: then the caller frees it). Raises EngineDeadError if the loop died."""
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
            if abort_on_exit and not finished and self._dead is None and not self._stopping():
                with contextlib.suppress(EngineDeadError):
                    await asyncio.shield(self.abort(request_id))  # consumer left: free it

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, detokenize: bool = True) -> AsyncIterator[RequestOutput]:
        """Stream a request's tokens. Raises InvalidRequestError before the first yield on bad input.

        ``detokenize=False``: token ids only (the caller does text and stop strings, as the router does)."""
        rid = request_id or uuid.uuid4().hex
        q = self.open_stream(rid)
        try:
            await self.add(rid, prompt_token_ids, params, detokenize)
        except BaseException:
            self.close_stream(rid)
            raise
        async for out in self.stream(rid, q):
            yield out

    async def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      detokenize: bool) -> tuple[asyncio.Queue, int, list[int]]:
        """Decode side: reserve blocks for imported KV and open the request's output stream.

        Returns (stream queue, leading blocks already cached, the request's block table)."""
        q = self.open_stream(request_id)
        try:
            num_cached, table = await self._reserve(request_id, prompt_token_ids, params, detokenize)
        except BaseException:
            self.close_stream(request_id)
            raise
        return q, num_cached, table

    # --- typed operations (subclasses) ---

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  detokenize: bool) -> None:  # pragma: no cover - abstract
        """Admit a whole prompt (its outputs go to the request's route)."""
        raise NotImplementedError

    async def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       detokenize: bool) -> tuple[int, list[int]]:  # pragma: no cover - abstract
        raise NotImplementedError

    async def kv_import_done(self, request_id: str, first_token: int, logprob: float | None,
                             top: TopLogprobs | None = None) -> bool:  # pragma: no cover - abstract
        """Decode side: every page landed; the request joins the running batch. False (nothing done)
        when the request is no longer waiting for its KV (expired or aborted meanwhile)."""
        raise NotImplementedError

    async def abort(self, request_id: str) -> bool:  # pragma: no cover - abstract
        """Cancel a request; an open stream of it ends with an ABORT output."""
        raise NotImplementedError

    async def import_payload(self, block_ids: list[int], payload: bytes | memoryview,
                             fp8: bool) -> None:  # pragma: no cover - abstract
        """Write page bytes (``payload``: the pages of ``block_ids`` in the cache's layout, or fp8-e4m3 wire
        pages) into the KV pool. Runs beside the steps: the blocks belong to a request not running yet."""
        raise NotImplementedError


class AsyncEngine(EngineFront):
    """The step loop on a thread of this process."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 engine: LLMEngine | None = None) -> None:
        super().__init__()
        self.engine = engine or LLMEngine(config, loaded)
        eng = self.engine
        self.tokenizer = eng.tokenizer
        self.model_id = eng.loaded.model_id
        self.layout = eng.layout
        self.fp8_layout = eng.fp8_layout
        self.vocab_size = eng.vocab_size
        self.max_model_len = eng.max_model_len
        self.ranks = eng.ranks
        self.device = config.device
        self._loop = StepLoop(eng, config, self._deliver)
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    @property
    def pages(self) -> Any:
        return pages_of(self.engine)

    @property
    def offered_pool(self) -> Any:  # type: ignore[override]
        return self.pages.destination

    @property
    def busy_s(self) -> float:
        """Seconds the engine thread has spent in steps since it started."""
        return self._loop.busy_s

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as e:
            log.exception("engine loop died")
            self._die(e)

    def _stopping(self) -> bool:
        return self._loop.stopping

    # --- engine thread ---

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one ``call_soon_threadsafe`` per event loop (one self-pipe
        write and one GIL hand-off per step, not per request); each route still gets its outputs in order."""
        batches: dict[asyncio.AbstractEventLoop, list[RequestOutput]] = {}
        for o in outputs:
            target = self._streams.get(o.request_id)
            if target is not None:
                batches.setdefault(target[0], []).append(o)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(self._put_all, items)

    # --- health ---

    def published_stats(self) -> dict[str, float]:
        """The engine's latest published figures (never waits on the engine thread): running, waiting,
        waiting_for_kv, free_blocks, total_blocks, kv_usage, published_unix (Unix s), cpu_threads (torch
        threads now: its share plus what peers lend, services/engine/cpu/core_share.py) and step_running_s
        (seconds the current step has run; 0 between steps)."""
        s = dict(self._loop.published)
        start = self._loop.step_start
        s["step_running_s"] = max(0.0, time.monotonic() - start) if start else 0.0
        return s

    def take_steps(self) -> list[StepRecord]:
        """The steps run since the previous call (oldest first; at most STEP_RECORDS_KEPT)."""
        return self._loop.take_steps()

    # --- caller side ---

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread between steps and return its result."""
        self._check_alive()
        return await asyncio.wrap_future(self._loop.submit(lambda: fn(*args)))

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  detokenize: bool) -> None:
        await self.call(self.engine.add_request, request_id, prompt_token_ids, params, detokenize)

    def _abort_now(self, request_id: str) -> bool:
        out = self.engine.abort(request_id)
        if out is not None:
            self._deliver([out])
        return out is not None

    async def abort(self, request_id: str) -> bool:
        return await self.call(self._abort_now, request_id)

    async def _reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       detokenize: bool) -> tuple[int, list[int]]:
        def add() -> tuple[int, list[int]]:
            seq, num_cached = self.engine.add_kv_import(request_id, prompt_token_ids, params, detokenize)
            return num_cached, list(seq.block_table)

        return await self.call(add)

    async def kv_import_done(self, request_id: str, first_token: int, logprob: float | None,
                             top: TopLogprobs | None = None) -> bool:
        def done() -> bool:
            outputs = self.engine.kv_import_done(request_id, first_token, logprob, top)
            if outputs is None:
                return False
            self._deliver(outputs)
            return True

        return await self.call(done)

    async def import_payload(self, block_ids: list[int], payload: bytes | memoryview, fp8: bool) -> None:
        await asyncio.to_thread(self.pages.import_payload, block_ids, payload, fp8)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._loop.stopping = True
        self._loop.wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._loop.leave_share_group()
        self.engine.runner.release()
