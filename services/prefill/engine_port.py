"""The prefill's engine as its servicer and KV streams use it, wherever the step loop runs.

* :class:`ThreadPrefillEngine`: the loop runs on a thread of this process (``AsyncEngine``). Chunk listeners run
  on that thread inside the step, page work queued with :meth:`run` runs there between steps, and a prompt's
  blocks are held past its end only when a stream asks (a deferred write after decode's claim).
* :class:`CorePrefillEngine`: the loop runs in an engine-core process (``EngineCoreClient``, role "prefill").
  The core's KV pool is a memfd this process maps, so the page work (exports for the wire, side-transport writes
  into decode's pool, the kvstore write-back) runs here, on the event loop, against the same memory. Each step's
  computed chunks arrive with its OUT frame and the core does not step again before they were read (TAKEN), so
  no later step reuses a block being read; a prompt's blocks are always held past its last chunk until
  :meth:`release` (or an abort). On a GPU the core's pool is one CUDA allocation this process opens by its IPC
  handle: the core synchronizes its device before an OUT frame lists chunks (their KV is written), and this
  process synchronizes its own copies out of a prompt's blocks before RELEASE gives them back.

Both give the listeners what the engine thread gave them: ``(chunk, sampled, step_start)`` with the chunk's
``seq.request_id``, ``seq.num_computed_tokens`` (before the chunk), ``seq.num_cached_tokens``,
``seq.block_table``, ``num_new_tokens`` and ``sample``.
"""

from __future__ import annotations

import abc
import asyncio
import os
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from services.engine import core_wire as w
from services.engine.async_engine import AsyncEngine, EngineDeadError, EngineFront
from services.engine.core_client import EngineCoreClient
from services.engine.kv_pages import KVPages, pages_of
from services.engine.parallel.split import HeadSplit
from services.engine.shared_kv import DTYPES, open_cuda_pool, open_front_pool
from services.text.sampling_params import Sampled, SamplingParams

ChunkListener = Callable[[Any, Sampled | None, float], None]


class PrefillEngine(abc.ABC):
    """What the prefill reaches of its engine (see the module docstring)."""

    front: EngineFront
    pages: KVPages
    holds_last_chunk = False
    """The engine holds every prompt's blocks past its last chunk until :meth:`release` (or an abort)."""
    layer_group = 0
    """Layers per group of a last chunk's layer-by-layer export (0: off; thread only)."""
    max_prefill_chunk = 0
    llm: Any = None
    """The in-process LLMEngine (layer-group exports reach it on its thread); None with an engine core."""

    @abc.abstractmethod
    def listen(self, fn: ChunkListener) -> None:
        """``fn(chunk, sampled, step_start)`` for every chunk computed (where: the module docstring)."""

    @abc.abstractmethod
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Page work (a deferred write or export): where the chunk listeners run."""

    @abc.abstractmethod
    def hold(self, seq: Any) -> None:
        """Listener: keep seq's blocks past its end (a deferred write reads them later)."""

    @abc.abstractmethod
    async def release(self, request_id: str, before: Callable[[], None] | None = None) -> None:
        """Free the blocks held past the prompt's end, after ``before()`` ran where the listeners run."""

    def dropped(self, request_id: str) -> None:
        """Listener: a prompt's last chunk for which no stream waits any more (its request ended here)."""
        return None  # an engine that holds no last chunk by itself has nothing to free

    @abc.abstractmethod
    def stall(self, seconds: float) -> None:
        """Listener, testing aid (--slowdown-ms-per-chunk): the step loop waits ``seconds`` more."""

    @abc.abstractmethod
    async def prefix_blocks(self, ids: list[int]) -> int:
        """Leading full blocks of the prompt the engine's prefix cache holds."""

    @abc.abstractmethod
    async def admit(self, request_id: str, ids: list[int], params: SamplingParams, stream_kv: bool, first: int,
                    pages: torch.Tensor | None) -> int:
        """The kvstore's ``pages`` (blocks first..) into the prefix cache, then the request, in one engine step;
        returns the blocks that loaded."""


class ThreadPrefillEngine(PrefillEngine):
    def __init__(self, front: AsyncEngine) -> None:
        self.front = front
        self.llm = self._eng = eng = front.engine
        self.pages = pages_of(eng)
        self.layer_group = eng.layer_group
        self.max_prefill_chunk = eng.config.max_prefill_chunk

    def listen(self, fn: ChunkListener) -> None:
        eng = self._eng
        eng.chunk_listeners.append(lambda ch, sampled: fn(ch, sampled, eng.last_step_start))

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await self.front.call(fn, *args)

    def hold(self, seq: Any) -> None:
        self._eng.hold_blocks(seq)

    def stall(self, seconds: float) -> None:
        time.sleep(seconds)  # on the engine thread

    async def release(self, request_id: str, before: Callable[[], None] | None = None) -> None:
        def release() -> None:
            if before is not None:
                before()
            self._eng.release_held(request_id)

        await self.front.call(release)

    async def prefix_blocks(self, ids: list[int]) -> int:
        return await self.front.call(self._eng.cached_prefix_blocks, ids)

    async def admit(self, request_id: str, ids: list[int], params: SamplingParams, stream_kv: bool, first: int,
                    pages: torch.Tensor | None) -> int:
        eng = self._eng

        def admit() -> int:
            loaded = eng.import_prefix_pages(ids, first, pages) if pages is not None else 0
            eng.add_request(request_id, ids, params, False, stream_kv=stream_kv)
            return loaded

        return await self.front.call(admit)


class CorePrefillEngine(PrefillEngine):
    holds_last_chunk = True

    def __init__(self, front: EngineCoreClient) -> None:
        if (front.pool_fd is None and front.pool_ipc is None) or front.pool_spec is None:
            raise RuntimeError("the prefill engine core sent no pool")
        shape, dtype, num_heads = front.pool_spec
        if front.pool_ipc is not None:  # shape and dtype in the handle's own fields, checked as it opens
            pool = open_cuda_pool(front.pool_ipc)
        else:
            try:
                pool = open_front_pool(front.pool_fd, tuple(int(d) for d in shape), DTYPES[dtype])
            finally:
                os.close(front.pool_fd)
                front.pool_fd = None
        self.front = front
        self.pages = KVPages(_PoolView(pool, int(num_heads)))
        self._listeners: list[ChunkListener] = []
        self._tasks: set[asyncio.Task] = set()
        self._stall = 0.0
        front.chunk_listener = self._computed

    def _computed(self, chunks: list[Any], step_start: float) -> float:
        """Event loop: one OUT frame's chunks, to the listeners; returns how much later TAKEN goes (``stall``)."""
        self._stall = 0.0
        for v in chunks:
            ch, sampled = w.chunk_from_wire(v)
            for fn in self._listeners:
                fn(ch, sampled, step_start)
        return self._stall

    def stall(self, seconds: float) -> None:
        self._stall += seconds  # the core waits for TAKEN that much longer; this loop goes on

    def listen(self, fn: ChunkListener) -> None:
        self._listeners.append(fn)

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)

    def hold(self, seq: Any) -> None:
        return None  # held by the core at the last chunk already

    async def release(self, request_id: str, before: Callable[[], None] | None = None) -> None:
        """Sends RELEASE without waiting for it: the core runs it between steps (a step may last seconds on a CPU),
        and the pages are out already."""
        if before is not None:
            before()
        self.dropped(request_id)

    def dropped(self, request_id: str) -> None:
        task = asyncio.ensure_future(self._release_quietly(request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release_quietly(self, request_id: str) -> None:
        try:
            if self.pages.device.type == "cuda":  # this process's copies out of the blocks ran before they go back
                await asyncio.to_thread(torch.cuda.synchronize, self.pages.device)
            await self.front.release(request_id)
        except EngineDeadError:
            pass  # the blocks died with the core

    async def prefix_blocks(self, ids: list[int]) -> int:
        return await self.front.prefix_blocks(ids)

    async def admit(self, request_id: str, ids: list[int], params: SamplingParams, stream_kv: bool, first: int,
                    pages: torch.Tensor | None) -> int:
        payload = memoryview(b"") if pages is None else _bytes(pages)
        return await self.front.admit(request_id, ids, params, stream_kv, first, payload)


def _bytes(pages: torch.Tensor) -> memoryview:
    return memoryview(pages.contiguous().view(torch.uint8).reshape(-1).numpy())


class _PoolView:
    """What KVPages (and rank-to-rank writes) read of a model runner, for a pool mapped from an engine core."""

    composite = False
    page_regions = None
    split = None
    kv_destination = None
    index_keys = None
    spec = None

    def __init__(self, pool: torch.Tensor, num_heads: int) -> None:
        self.kv_cache = pool
        self.device = pool.device
        self.dtype = pool.dtype
        self.num_layers, _, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = pool.shape
        self.model = SimpleNamespace(tp_split=HeadSplit(num_heads, self.num_kv_heads))

    def write_pages(self, block_ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        raise RuntimeError("a prefill front does not write its core's pages (kvstore pages go in with ADMIT)")


def prefill_engine(front: EngineFront) -> PrefillEngine:
    """The prefill's engine for the front its service started."""
    if isinstance(front, EngineCoreClient):
        return CorePrefillEngine(front)
    assert isinstance(front, AsyncEngine)
    return ThreadPrefillEngine(front)
