"""A rank's page writes into decode's pools, split into start and finish, and the acknowledgements that tell rank 0
when every rank's writes of a chunk have landed.

Start (the engine thread of each rank, when rank 0's RANK_PAGES/WRITE plan arrives; on rank 0 right after sending
it): shm / cuda-ipc copies run at once (a CUDA copy records an event), Mooncake batches are submitted, a head slice
that goes through a writer rank's staging buffer is deferred. Finish (rank 0: the request's pump worker thread
in ``PageWriter.wait``; ranks 1..N-1: their ``Settler`` thread): the deferred writes run, the batches settle, the
events are waited for. Then a rank acknowledges the chunk (``Acks``: a key per (chunk, rank) on the instance's
TCPStore, never a collective: the engine threads go on with the next plan while the bytes move). Rank 0 sends the
chunk's descriptor on PushKV only once its own finish and every other rank's acknowledgement are in.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch
import torch.distributed as dist

from services.engine.kv_layout import HeadSplitSpec
from services.engine.kv_transport.base import PageWriter, TransferError
from services.engine.kv_transport.shared_pool import check_blocks, copy_pages_peer
from services.engine.parallel.group import COLLECTIVE_TIMEOUT_S, open_store
from services.engine.parallel.mooncake_ranks import RemotePool, settle_writes
from services.engine.parallel.rank_regions import RegionShard, write_regions
from services.engine.parallel.split import HeadSplit
from services.engine.shared_kv import _runs

if TYPE_CHECKING:
    from services.engine.parallel.rank_pages import ShardWrites

log = logging.getLogger(__name__)

ACK_POLL_S = 0.5
"""Rank 0 checks the ranks' liveness this often while it waits for acknowledgements (seconds)."""
ACK_FAILED_EXIT = 3
"""Exit status of a rank that could not post an acknowledgement to rank 0 (launch.RankSet sees it die)."""


@dataclass(frozen=True)
class Shard:
    heads: tuple[int, int]
    """[start, end) of the KV heads this pool holds."""
    pool: torch.Tensor | RemotePool
    """[layers, 2, blocks, block_size, end - start, head_dim] (mapped here, or a decode rank's over Mooncake)."""


def copy_heads(src: torch.Tensor, src_blocks: list[int], src_heads: tuple[int, int], dst: torch.Tensor,
               dst_blocks: list[int], dst_heads: tuple[int, int]) -> None:
    """dst[:, :, dst_blocks[i], :, c:d] = src[:, :, src_blocks[i], :, a:b] (caches [L, 2, blocks, bs, heads, D]):
    on the CPU one strided copy per run of consecutive blocks, on GPUs shared_pool.copy_pages_peer (gather, one
    copy, scatter). Block ids are checked against both caches."""
    (a, b), (c, d) = src_heads, dst_heads
    assert b - a == d - c > 0
    if src.is_cuda or dst.is_cuda:
        copy_pages_peer(src, src_blocks, dst, dst_blocks, src_heads, dst_heads)
        return
    check_blocks(src_blocks, src.shape[2], "source")
    check_blocks(dst_blocks, dst.shape[2], "destination")
    for s, t, n in _runs(src_blocks, dst_blocks):
        dst[:, :, t:t + n, :, c:d].copy_(src[:, :, s:s + n, :, a:b])


@dataclass
class ShareWrite:
    """One rank's part of one chunk, started; ``finish`` (any thread, once) returns when all of it has landed."""

    written: int = 0
    """Page slices this rank writes (a page into k shards: k)."""
    batches: list[tuple[object, int]] = field(default_factory=list)
    """Mooncake batches in flight."""
    deferred: list[Callable[[], None]] = field(default_factory=list)
    """Blocking writes left for ``finish`` (a head slice gathered through the staging buffer)."""
    events: list[torch.cuda.Event] = field(default_factory=list)
    """One per CUDA device the copies ran on, recorded after them."""

    def finish(self) -> int:
        """Blocks until every byte of the share has landed; TransferError on a failed Mooncake write."""
        try:
            for run in self.deferred:
                run()
        finally:
            settle_writes(self.batches)  # nothing of this chunk is in flight once this returns
            for ev in self.events:
                ev.synchronize()
        return self.written


def start_share(cache: torch.Tensor, split: HeadSplit, shards: list[Shard], src_blocks: list[int],
                dst_blocks: list[int], regions: list[RegionShard] | None = None) -> ShareWrite:
    """Start this rank's part of a chunk: its heads' intersection with every shard, over its share of the pages
    (replicas of a head split the pages evenly; which replica takes the larger share turns with the first
    destination block, so one-page chunks do not all fall to one replica), and its share of the pages of every
    replicated region into every decode pool of it (``regions``: rank_regions.py). A failure (ValueError for
    block ids outside a pool) settles whatever this share had submitted, then raises."""
    a, b = split.kv_range
    reps = split.kv_replicas
    k, n = (split.rank + (dst_blocks[0] if dst_blocks else 0)) % reps, len(src_blocks)
    lo, hi = k * n // reps, (k + 1) * n // reps
    out = ShareWrite()
    try:
        for sh in shards if hi > lo else []:
            s, e = max(a, sh.heads[0]), min(b, sh.heads[1])
            if s >= e:
                continue
            src, heads, dst, dst_heads = src_blocks[lo:hi], (s - a, e - a), dst_blocks[lo:hi], (s - sh.heads[0],
                                                                                                e - sh.heads[0])
            if isinstance(sh.pool, RemotePool) and sh.pool.gathers(heads, dst_heads, cache):
                pool = sh.pool
                check_blocks(src, cache.shape[2], "source")
                check_blocks(dst, pool.shape[2], "destination")
                out.deferred.append(lambda p=pool, x=src, h=heads, y=dst, g=dst_heads: p.write_heads(cache, x, h, y, g))
            elif isinstance(sh.pool, RemotePool):
                out.batches += sh.pool.write_heads(cache, src, heads, dst, dst_heads)
            else:
                copy_heads(cache, src, heads, sh.pool, dst, dst_heads)
            out.written += hi - lo
        out.batches += write_regions(split, regions or [], src_blocks, dst_blocks)
    except BaseException:
        settle_writes(out.batches)  # a failed start leaves nothing in flight
        raise
    for dev in {t.device for t in (cache, *(sh.pool for sh in shards), *(r.pool for r in regions or []))}:
        if dev.type == "cuda":  # the pages must have landed before rank 0 is told they have
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            out.events.append(ev)
    return out


def write_share(cache: torch.Tensor, split: HeadSplit, shards: list[Shard], src_blocks: list[int],
                dst_blocks: list[int], regions: list[RegionShard] | None = None) -> int:
    """start_share and finish in one (the pages have landed when it returns); page slices written."""
    return start_share(cache, split, shards, src_blocks, dst_blocks, regions).finish()


def _key(seq: int, rank: int) -> str:
    return f"pdserve/rank-pages/ack/{seq}/{rank}"


class SilentRanks(TransferError):
    """Live ranks that never acknowledged a chunk: their writes may still land, so they are taken as dead."""

    def __init__(self, ranks: list[int], message: str) -> None:
        super().__init__(message, grpc.StatusCode.UNAVAILABLE)
        self.ranks = ranks


class Acks:
    """Per-chunk acknowledgements of ranks 1..N-1 to rank 0 over the instance's TCPStore (rank 0 serves it at
    127.0.0.1:``port``): rank r sets ``pdserve/rank-pages/ack/<seq>/<r>`` to its page-slice count, or to
    ``!<error>`` when its share failed; rank 0 waits for those keys, reads and deletes them. Each thread talks
    through its own store connection (a TCPStore connection serializes its calls: a wait would hold up others)."""

    def __init__(self, port: int, size: int) -> None:
        self.port, self.size = port, size
        self._local = threading.local()

    def _store(self) -> dist.TCPStore:
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = open_store(self.size, self.port)
        return store

    def post(self, seq: int, rank: int, written: int, error: str = "") -> None:
        """Ranks 1..N-1: this rank's share of chunk ``seq`` has landed (``written`` slices) or failed (``error``)."""
        self._store().set(_key(seq, rank), f"!{error}" if error else str(written))

    def collect(self, seq: int, ranks: range, alive: Callable[[], None],
                deadline: float | None = None) -> tuple[list[int], list[str]]:
        """Rank 0: every rank's acknowledgement of chunk ``seq`` (page slices per rank in ``ranks``' order, and the
        errors reported); ``alive`` raises when a rank has died. SilentRanks when a live rank has not answered by
        ``deadline`` (time.monotonic(); None: COLLECTIVE_TIMEOUT_S from now). Every key read is deleted."""
        store, keys = self._store(), [_key(seq, r) for r in ranks]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S if deadline is None else deadline
        while True:
            alive()
            try:
                store.wait(keys, datetime.timedelta(seconds=ACK_POLL_S))
                break
            except dist.DistStoreError:  # not all in yet: slow is not dead, the liveness check says which
                if time.monotonic() > deadline:
                    missing = [r for r, k in zip(ranks, keys, strict=True) if not store.check([k])]
                    for k in keys:  # the answers that did come are dropped with the chunk
                        store.delete_key(k)
                    raise SilentRanks(missing, f"tensor-parallel ranks {missing} did not report their page "
                                               f"writes of a chunk in time") from None
        counts, errors = [], []
        for r, k in zip(ranks, keys, strict=True):
            value = store.get(k).decode()
            store.delete_key(k)
            if value.startswith("!"):
                counts.append(0)
                errors.append(f"rank {r}: {value[1:]}")
            else:
                counts.append(int(value))
        return counts, errors


class Settler:
    """Ranks 1..N-1: one thread that finishes this rank's shares in the order they started and acknowledges each
    to rank 0, so the rank's engine thread goes on with the next plan while its bytes move."""

    def __init__(self, acks: Acks, rank: int) -> None:
        self.acks, self.rank = acks, rank
        self._queue: queue.Queue[tuple[int, ShareWrite | BaseException]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"pdserve-tp-rank{rank}-writes", daemon=True)
        self._thread.start()

    def put(self, seq: int, share: ShareWrite | BaseException) -> None:
        self._queue.put((seq, share))

    def _run(self) -> None:
        while True:
            seq, share = self._queue.get()
            written, error = 0, ""
            try:
                if isinstance(share, BaseException):
                    raise share
                written = share.finish()
            except Exception as e:  # reported to rank 0, which fails the request; this rank keeps serving
                log.warning("tensor-parallel rank %d failed to write pages: %r", self.rank, e)
                error = repr(e)[:512]
            try:
                self.acks.post(seq, self.rank, written, error)
            except Exception as e:  # rank 0 would wait out its bound for every later chunk: it sees this rank die
                log.critical("tensor-parallel rank %d cannot acknowledge chunk %d to rank 0 (%r): the rank exits",
                             self.rank, seq, e)
                os._exit(ACK_FAILED_EXIT)


Opened = tuple[list[Shard], list[RegionShard]]
"""A destination as one rank opened it: the KV shards this rank writes, and every decode pool of each replicated
region (rank_regions.py)."""


@dataclass(frozen=True)
class Attached:
    """A destination every rank opened for one request: its attach id, rank 0's own shards of it, the blocks of
    its smallest pool (a destination block id must be below it) and rank 0's opened pools of the replicated regions
    (index keys; rank_regions.py)."""

    id: int
    shards: list[Shard]
    blocks: int
    regions: list[RegionShard] = field(default_factory=list)

    @classmethod
    def of(cls, aid: int, opened: Opened) -> Attached:
        """Rank 0's ``opened`` destination as ``aid``; its blocks: its smallest pool's (region pools included)."""
        shards, regions = opened
        return cls(aid, shards, min(p.shape[2] for p in [*(s.pool for s in shards), *(r.pool for r in regions)]),
                   regions)


class ChunkWrite:
    """One chunk's writes on every rank (ShardWriter's handle); finished by exactly one thread, waited by any."""

    def __init__(self, seq: int, own: ShareWrite | None, error: Exception | None) -> None:
        self.seq = seq
        self.own = own
        """Rank 0's share, started (None when its start failed: ``error``)."""
        self.error = error
        self.failure: TransferError | None = None
        self.claimed = False
        self.done = threading.Event()
        self.lock = threading.Lock()


class ShardWriter(PageWriter):
    """One request's writer: every rank writes its heads straight into the decode ranks' pools. ``write`` starts a
    chunk on every rank, ``wait`` (the pump's worker thread) returns once all of it has landed; over Mooncake the
    bytes move while the next chunk computes (``overlaps_compute``), shm / cuda-ipc copies run in the start."""

    def __init__(self, writes: ShardWrites, transport: str, pool: str, attached: Attached, dest_blocks: list[int],
                 splits: tuple[HeadSplitSpec, HeadSplitSpec], overlaps_compute: bool = False) -> None:
        self.transport = transport
        self.overlaps_compute = overlaps_compute
        """The caller's connector says: True when the rank writes finish in ``wait`` (over Mooncake)."""
        self.pool_id = pool
        self.writes = writes
        self.attached = attached
        self.dest = dest_blocks
        self.sender = None
        self.splits = splits
        self._pending: list[ChunkWrite] = []
        self._lock = threading.Lock()

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        w = self.writes.start(self.attached, src_blocks, self.dest[first_block:first_block + len(src_blocks)])
        with self._lock:
            self._pending.append(w)
        return w

    def wait(self, handle: object) -> None:
        self._wait(handle, None)

    def _wait(self, handle: object, deadline: float | None) -> None:
        if handle is None:
            return
        assert isinstance(handle, ChunkWrite)
        try:
            self.writes.finish(handle, deadline)
        finally:
            with self._lock:
                if handle in self._pending:
                    self._pending.remove(handle)

    def quiesce(self) -> None:
        """Block until no chunk of this request is in flight on any rank (a rank silent past one deadline for all
        of them is killed: ShardWrites.finish); failures are reported by :meth:`wait`."""
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        with self._lock:
            pending = list(self._pending)
        for w in pending:
            with contextlib.suppress(TransferError):
                self._wait(w, deadline)
