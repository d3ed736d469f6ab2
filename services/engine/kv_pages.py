"""The engine's page export/import API: the only way services touch KV pages (never ``engine.runner``).

Thread rules:
  * ``export`` runs on the engine thread (inside a chunk listener, while the source blocks are held).
    On CPU it gathers the pages into a fresh host tensor (one memcpy; checksums and encoding happen
    later in a worker). On GPU it only enqueues work: a gather stream waits for the step's compute and
    gathers the pages into a device staging buffer (one kernel); a copy stream waits for that gather and
    copies it to pinned host memory asynchronously; the compute stream waits for the gather only
    (GPU-side). Gathers and copies have a stream each so that a gather never queues behind an earlier
    export's copy: with one side stream the next chunk's compute waited 13-16 ms for them at 8K tokens
    (benchmarks/tail_probe.py on the H200, docs/reports/performance-history-2026-12-01.md). ``PageExport.wait`` (a worker thread) blocks
    until the host bytes are ready.
  * ``import_pages`` writes into blocks a reservation owns and the engine does not read until the
    import is done (kv_import_done), so it may run in a worker thread; pages for blocks the engine
    uses (the prefix cache) go through the engine thread instead (LLMEngine.import_prefix_pages).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from services.common.pb import decode_pb2
from services.engine.kv_layout import FP8_CODEC
from services.engine.kv_transport.grpc_wire import IN_PLACE, MessageBuffer
from services.engine.page_regions import pack_regions
from services.engine.parallel.rank_pages import ShardWrites
from services.engine.region_pools import RegionPool, runner_regions
from services.kernels import pack_pages, pack_pages_fp8


@dataclass
class PageExport:
    """Pages of a chunk on their way to host memory: [P, layers, 2, bs, kvh, hd] (cache dtype) or uint8
    [P, fp8 page bytes]."""

    host: torch.Tensor
    done: torch.cuda.Event | None = None
    """Recorded on the side stream after the device-to-host copy (GPU only)."""

    def wait(self) -> torch.Tensor:
        """Worker thread: the host pages, once they are there."""
        if self.done is not None:
            self.done.synchronize()
        return self.host


@dataclass
class MessageExport:
    """Pages of a chunk already inside the PushKV messages that carry them (CPU, KVPages.export_messages):
    (pages, message) in order."""

    pieces: list[tuple[int, MessageBuffer]]


def gather_messages(export, block_ids: list[int], pages_per_message: int, room: int, page_nbytes: int,
                    page_shape: tuple[int, ...], dtype: torch.dtype) -> MessageExport:
    """``export(ids, out)`` of each run of ``pages_per_message`` pages into a fresh MessageBuffer's payload
    ([pages, *page_shape] of ``dtype``, ``page_nbytes`` per page)."""
    pieces = []
    for first in range(0, len(block_ids), pages_per_message):
        ids = block_ids[first:first + pages_per_message]
        buf = MessageBuffer(len(ids) * page_nbytes, room)
        export(ids, torch.frombuffer(buf.writable, dtype=dtype, offset=room).view(len(ids), *page_shape))
        pieces.append((len(ids), buf))
    return MessageExport(pieces)


class KVPages:
    def __init__(self, runner) -> None:
        self._runner = runner
        self.device = runner.device
        self._side: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None
        """(gather, copy) side streams (GPU): a gather never queues behind an earlier export's device-to-host copy."""
        self.exporters: list[object] = []
        self._shard_writes = None
        """What serves this pool to other processes (a Mooncake engine): kept as long as the engine."""

    @property
    def pool(self) -> torch.Tensor:
        """The KV pool [layers, 2, blocks, block_size, kv_heads, head_dim] (side transports write into it)."""
        return self._runner.kv_cache

    @property
    def destination(self) -> decode_pb2.KVDestination | None:
        """The pool as a same-host prefill may open it (shm / CUDA IPC; at TP>1 every rank's pool, a ShardedPool);
        None when private."""
        if self.sharded:
            return self.shard_writes().offer()
        return self._runner.kv_destination

    def shard_writes(self):
        """Rank-to-rank page writes of this instance's ranks into a decode's pools (parallel/rank_pages.py)."""
        if self._shard_writes is None:
            self._shard_writes = ShardWrites(self._runner)
        return self._shard_writes

    @property
    def sharded(self) -> bool:
        """The pool is split over tensor-parallel ranks: grpc and kvstore pages leave and enter with all heads
        through rank 0's runner (services/engine/parallel); side transports write rank to rank (shard_writes)."""
        return getattr(self._runner, "split", None) is not None  # parallel.runner.TPModelRunner

    @property
    def composite(self) -> bool:
        """Pages carry regions beside the target's (DeepSeek-V3.2's index keys, a draft's KV): they cross as uint8
        [P, page bytes] of every region in layout order (page_regions.py)."""
        return self._runner.composite

    @property
    def region_pools(self) -> list[RegionPool]:
        """(region, pool) of each page region beside the target's, in layout order: what a side transport writes
        besides the target pool (region_pools.py); empty for a target-only page."""
        return runner_regions(self._runner)

    @property
    def page_shape(self) -> tuple[int, ...]:
        """One page as it crosses the instance boundary: all KV heads, whatever the TP degree; with more regions
        than the target, (page bytes,) of all of them (target in the cache's dtype, the others in their codecs)."""
        r = self._runner
        if self.composite:
            return (r.page_nbytes(None),)
        return (r.num_layers, 2, r.block_size, r.split.num_kv_heads if self.sharded else r.num_kv_heads, r.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.composite else self._runner.dtype

    @property
    def exports_layers(self) -> bool:
        """``export`` may take a layer range (native pages of an unsharded pool of the target region alone)."""
        return not self.sharded and not self.composite

    def export(self, block_ids: list[int], codec: str | None = None, out: torch.Tensor | None = None,
               layers: tuple[int, int] | None = None) -> PageExport:
        """Engine thread: start copying the pages of ``block_ids`` to the host (see the module docstring);
        into ``out`` when given (host memory of the pages' shape, pinned on GPU: a transport's registered
        staging buffer); pages of several regions (``composite``) are uint8 [P, page bytes of every region].
        ``layers`` (a, b): only those layers of each page, [P, b - a, 2, bs, kvh, hd] (native codec,
        ``exports_layers``), e.g. inside a layer sink once the forward queued them (layer_groups.py): the gather
        waits on the compute stream for what it queued so far."""
        if layers is not None:
            assert codec != FP8_CODEC and self.exports_layers, "a layer range is exported in the native codec only"
        if self.sharded:  # every rank's heads, gathered by rank 0 (one collective, synchronous)
            return PageExport(self._runner.read_pages(block_ids, codec))
        # Pages of several regions: each region packed and the page's bytes joined (page_regions.py), on the same
        # side streams as a target-only page on GPU.
        regions = self._runner.page_regions if self.composite else None
        pack = pack_pages_fp8 if codec == FP8_CODEC else pack_pages
        cache = self._runner.kv_cache if layers is None else self._runner.kv_cache[layers[0]:layers[1]]  # contiguous
        if not cache.is_cuda:
            idx = torch.tensor(block_ids, dtype=torch.int64)
            if regions is not None:  # joined straight into ``out`` when given
                return PageExport(pack_regions(regions, idx, codec, out))
            if codec != FP8_CODEC:  # gathered straight into ``out`` when given
                pages = pack(cache, idx, out)
                return PageExport(pages if out is None else out)
            pages = pack(cache, idx)
            return PageExport(pages if out is None else out.copy_(pages))
        if self._side is None:
            self._side = (torch.cuda.Stream(device=cache.device), torch.cuda.Stream(device=cache.device))
        compute = torch.cuda.current_stream(cache.device)
        gather, copy = self._side
        gather.wait_stream(compute)  # the chunk's KV is written
        with torch.cuda.stream(gather):
            idx = torch.tensor(block_ids, dtype=torch.int64).pin_memory().to(cache.device, non_blocking=True)
            staged = pack(cache, idx) if regions is None else pack_regions(regions, idx, codec)
            gathered = torch.cuda.Event()
            gathered.record(gather)
        copy.wait_event(gathered)
        with torch.cuda.stream(copy):
            host = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True) if out is None else out
            host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(copy)
        # Later steps may reuse these blocks once the request ends: they run after the gather, on the GPU.
        compute.wait_event(gathered)
        staged.record_stream(copy)
        idx.record_stream(gather)
        return PageExport(host, done)

    @property
    def exports_messages(self) -> bool:
        """``export_messages`` applies: CPU pages of an unsharded pool of the target region alone, on CPython."""
        return IN_PLACE and self.device.type == "cpu" and not self.sharded and not self.composite

    def export_messages(self, block_ids: list[int], codec: str | None, pages_per_message: int, room: int,
                        page_nbytes: int) -> MessageExport:
        """Engine thread (CPU, ``exports_messages``): the pages of ``block_ids`` gathered straight into the
        PushKV messages that will carry them, ``pages_per_message`` pages of ``page_nbytes`` bytes each, after
        ``room`` bytes for each header (grpc_wire.MessageBuffer): no copy between the pool and gRPC's."""
        fp8 = codec == FP8_CODEC
        return gather_messages(lambda ids, out: self.export(ids, codec, out), block_ids, pages_per_message, room,
                               page_nbytes, (page_nbytes,) if fp8 else self.page_shape,
                               torch.uint8 if fp8 else self.dtype)

    def import_pages(self, block_ids: list[int], pages: torch.Tensor, codec: str | None = None) -> None:
        """Write pages (the layout ``export`` produces) into reserved blocks (any thread; see above)."""
        self._runner.write_pages(block_ids, pages, codec)

    def import_payload(self, block_ids: list[int], payload: bytes | memoryview, fp8: bool) -> None:
        """:meth:`import_pages` from raw bytes (a received message's payload, read only): the pages of
        ``block_ids`` in the cache's own layout, or fp8-e4m3 wire pages when ``fp8`` (any thread)."""
        if not block_ids:
            return
        if fp8:
            self.import_pages(block_ids, self.payload_pages(payload, fp8).view(len(block_ids), -1), FP8_CODEC)
        else:
            self.import_pages(block_ids, self.payload_pages(payload).view(len(block_ids), *self.page_shape))

    def payload_pages(self, payload: bytes | bytearray | memoryview, fp8: bool = False) -> torch.Tensor:
        """Raw page bytes (read only, never copied) as a tensor: [P, *page_shape] of the cache's dtype, or flat
        uint8 for fp8-e4m3 wire pages."""
        with warnings.catch_warnings():  # a read-only view of the bytes: only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(payload, dtype=torch.uint8 if fp8 else self.dtype)
        return flat if fp8 else flat.view(-1, *self.page_shape)


def pages_of(engine) -> KVPages:
    """The page API of an LLMEngine (``engine.kv_pages``, made with its runner)."""
    return engine.kv_pages
