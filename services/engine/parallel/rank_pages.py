"""Pages rank to rank: side transports (shm on CPU, cuda-ipc on GPU, mooncake on host pools) between
tensor-parallel instances.

Decode: every rank's KV shard is its own shared pool; rank 0 collects them once (RANK_PAGES/POOLS: each
rank's KVDestination gathered to rank 0) into one typed ``ShardedPool`` that Reserve offers (rank r: KV
heads [a, b); a head held by several ranks is in each replica's pool).

Prefill: a request's destination (a ShardedPool, or one plain pool holding all heads) is opened by every
rank before the claim (RANK_PAGES/ATTACH; any rank failing means the pages go as bytes in the stream) and kept
by every rank under the attach id rank 0 gave it. For each chunk rank 0 announces RANK_PAGES/WRITE (the attach
id, the chunk's sequence number, source and destination block ids: never the destination again); every rank
starts writing the intersection of its heads with each decode rank's heads straight into that rank's pool (a
head replicated on the prefill side: its replicas split the pages; replicated on the decode side: written into
every replica), and its share of the pages of each replicated region (DeepSeek-V3.2's index keys) into every
decode rank's pool of it (rank_regions.py), and goes on with the next plan. Each rank finishes its share off its
engine thread and acknowledges the chunk to rank 0 (rank_writes.py: a key on the instance's TCPStore, no
collective); rank 0's writer waits for its own share and every acknowledgement in the request's pump thread
(``PageWriter.wait``), and only then sends the chunk's descriptor on the PushKV stream. No page passes through
rank 0.

Over mooncake (mooncake_ranks.py) each rank uses its own transfer engines: rank 0 hands every rank the host
and engine count (POOLS on decode, ATTACH on prefill) and each rank starts its engines there (rank 0's are the
only ones its prefill uses, for plain pools as well: services/kv/shards.py); a decode rank registers its index-key
pool with them too, beside its shard, and a prefill rank writes it there (rank_regions.py).

Plan message: header [Op.RANK_PAGES, sub, n, m, k, a, b, 0] and an int64 payload. WRITE: n pages, a the chunk's
sequence number, b the attach id; payload source block ids[n] | destination block ids[n]. ATTACH: n Mooncake
engines, m destination bytes, k host bytes (0: no Mooncake), a the attach id; payload host bytes[k] |
destination bytes[m]. POOLS: n Mooncake engines, m host bytes (0: each rank's own shm / CUDA IPC pool); payload
host bytes[m]. The destination is KVDestination protobuf bytes (parsed as that type, never code); the host is
text (a name or address, never a path); a rank opens nothing but what shared_kv's and mooncake's checks allow.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import itertools
import logging
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import grpc
import torch

from services.common.kv_kinds import PoolKind, pool_kind
from services.common.pb import decode_pb2
from services.engine.errors import EngineDeadError
from services.engine.kv_layout import HeadSplitSpec, Region
from services.engine.kv_transport.base import TransferError
from services.engine.parallel.mooncake_ranks import RankMooncake, RemotePool, RemoteRegion, host_text
from services.engine.parallel.plan import Op
from services.engine.parallel.rank_regions import check_regions, open_regions, shm_files
from services.engine.parallel.rank_writes import (
    Acks,
    Attached,
    ChunkWrite,
    Opened,
    Settler,
    Shard,
    ShareWrite,
    SilentRanks,
    start_share,
)
from services.engine.parallel.split import HeadSplit, TensorParallelError
from services.engine.region_pools import RegionPool, attach_region_pool, runner_regions
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools

log = logging.getLogger(__name__)

MAX_DEST_BYTES = 4096
"""Longest serialized per-rank KVDestination a rank hands rank 0 (a CUDA IPC pool is ~300 bytes)."""
MAX_TP = 64
"""Largest tensor-parallel size a ShardedPool may name."""
ATTACHED_MAX = 4096
"""Destinations a rank keeps attached (the most recently attached or written): far more than the requests one
prefill runs at once."""


class Sub(enum.IntEnum):
    POOLS = 1
    ATTACH = 2
    WRITE = 3


def spec_of(split: HeadSplit) -> HeadSplitSpec:
    return HeadSplitSpec(split.tp_size, split.local_kv_heads, split.kv_replicas)


def head_ranges(tp_size: int, num_kv_heads: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the KV heads at ``tp_size`` (the split every instance uses)."""
    return [HeadSplit(tp_size * num_kv_heads, num_kv_heads, tp_size, r).kv_range for r in range(tp_size)]


def transport_of(dest: decode_pb2.KVDestination) -> str:
    """The side transport that writes a destination ("" for none / a pool of another kind)."""
    kind = pool_kind(dest)
    if kind is not None and kind.per_rank:
        inner = {pool_kind(rp.pool) for rp in dest.sharded.ranks}
        return _plain_transport(inner.pop()) if len(inner) == 1 else ""
    return _plain_transport(kind)


def _plain_transport(kind: PoolKind | None) -> str:
    """The transport that writes a plain pool of ``kind`` (a rank's own pool may be one); "" for another kind."""
    return kind.transport if kind is not None and kind.plain else ""


def _plain(dest: decode_pb2.KVDestination) -> bool:
    """Whether ``dest`` offers one plain pool (what a rank's own pool may be)."""
    kind = pool_kind(dest)
    return kind is not None and kind.plain


def sharded_destination(split: HeadSplit, pools: list[decode_pb2.KVDestination]) -> decode_pb2.KVDestination:
    """Decode's offer: every rank's pool (rank order) with the heads it holds."""
    out = decode_pb2.KVDestination()
    sp = out.sharded
    sp.tp_size, sp.num_kv_heads, sp.kv_replicas = split.tp_size, split.num_kv_heads, split.kv_replicas
    for r, (pool, (a, b)) in enumerate(zip(pools, head_ranges(split.tp_size, split.num_kv_heads), strict=True)):
        sp.ranks.add(rank=r, kv_head_start=a, kv_head_end=b, pool=pool)
    return out


def pool_split(dest: decode_pb2.KVDestination, num_kv_heads: int) -> HeadSplitSpec:
    """The head split of the pool a destination names (a plain pool holds every head)."""
    kind = pool_kind(dest)
    if kind is not None and kind.per_rank:
        sp = dest.sharded
        return HeadSplitSpec(sp.tp_size, max(1, num_kv_heads // max(1, sp.tp_size)), sp.kv_replicas)
    return HeadSplitSpec(1, num_kv_heads, 1)


def open_shards(dest: decode_pb2.KVDestination,
                attach: Callable[[decode_pb2.KVDestination], torch.Tensor | RemotePool],
                cache: torch.Tensor, num_kv_heads: int, heads: tuple[int, int] | None = None) -> list[Shard]:
    """Check a destination against this model and open its pools (``attach``: shared_kv's checked open), only
    those holding one of ``heads`` ([start, end), this rank's; None: all; a CUDA IPC open costs a context on
    the pool's device). Raises SharedKVAttachError (reason ``split``: a head split this prefill cannot write; ``shape``: a pool
    of another shape or dtype) so the pages go as bytes in the stream instead."""
    kind = pool_kind(dest)
    if kind is not None and kind.plain:
        shards = [Shard((0, num_kv_heads), attach(dest))]
    elif kind is not None and kind.per_rank:
        want = _rank_heads(dest.sharded, num_kv_heads)
        lo, hi = heads or (0, num_kv_heads)
        shards = [Shard(want[i], attach(rp.pool)) for i, rp in enumerate(dest.sharded.ranks)
                  if max(lo, want[i][0]) < min(hi, want[i][1])]
    else:
        raise SharedKVAttachError("none", f"the decode offers {kind.case if kind else 'no shared pool'}")
    for sh in shards:
        _check_shard(sh, cache)
    return shards


def _rank_heads(sp: decode_pb2.ShardedPool, num_kv_heads: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the KV heads, when ``sp`` splits this model's heads as every instance does
    (rank order, plain pools); else SharedKVAttachError (reason ``split``)."""
    if not 1 <= sp.tp_size <= MAX_TP or sp.num_kv_heads != num_kv_heads:
        raise SharedKVAttachError("split", f"decode's pool splits {sp.num_kv_heads} KV heads over {sp.tp_size} "
                                           f"ranks; this model has {num_kv_heads} KV heads")
    try:
        want = head_ranges(sp.tp_size, num_kv_heads)
    except TensorParallelError as e:
        raise SharedKVAttachError("split", f"decode's pool: {e}") from e
    got = [(rp.rank, rp.kv_head_start, rp.kv_head_end, _plain(rp.pool)) for rp in sp.ranks]
    if sp.kv_replicas != max(1, sp.tp_size // num_kv_heads) or len(got) != sp.tp_size or any(
            (r, a, b) != (i, *want[i]) or not plain for i, (r, a, b, plain) in enumerate(got)):
        raise SharedKVAttachError("split", f"decode's pool names ranks/heads {[g[:3] for g in got]} with "
                                           f"{sp.kv_replicas} replicas; TP={sp.tp_size} over {num_kv_heads} KV "
                                           f"heads splits them as {want}")
    return want


def _check_shard(sh: Shard, cache: torch.Tensor) -> None:
    """A rank pool holds pages of this cache's shape and dtype for exactly its heads (else reason ``shape``)."""
    p = sh.pool
    if (p.shape[:2] != cache.shape[:2] or p.shape[3] != cache.shape[3] or p.shape[5] != cache.shape[5]
            or p.shape[4] != sh.heads[1] - sh.heads[0] or p.dtype != cache.dtype):
        raise SharedKVAttachError("shape", f"decode's pool for KV heads {sh.heads} is {tuple(p.shape)} {p.dtype}; "
                                           f"this cache is {tuple(cache.shape)} {cache.dtype}")


class RankPools:
    """One rank's opened destinations (each decode pool mapped once, shared_kv.SharedKVPools; the region pools in a
    cache of their own, so a decode's rank pools and index-key pools stay mapped together), those attached for a
    request (by attach id, the ATTACHED_MAX most recently attached or written), and (ranks 1..N-1) its write
    settler."""

    def __init__(self, cache: torch.Tensor, split: HeadSplit) -> None:
        self.cache = cache
        self.split = split
        self.pools = SharedKVPools()
        self.region_pools = SharedKVPools()
        self.mooncake = RankMooncake()
        self._lock = threading.Lock()  # ATTACH runs in a worker thread, WRITE on the engine thread
        self._attached: OrderedDict[int, Opened] = OrderedDict()
        self._settler: Settler | None = None

    def _attach(self, dest: decode_pb2.KVDestination) -> torch.Tensor | RemotePool:
        kind = pool_kind(dest)
        if kind is not None and kind.remote:
            return self.mooncake.remote(dest, self.cache)
        return self.pools.attach(dest)

    def _attach_region(self, dest: decode_pb2.KVDestination, region: Region, cache: torch.Tensor
                       ) -> torch.Tensor | RemoteRegion:
        """A decode pool's pool of ``region`` (check_regions has checked it is written as the target pool is)."""
        kind = pool_kind(dest)
        if kind is not None and kind.remote:
            return self.mooncake.region(dest, region, cache)
        return attach_region_pool(self.region_pools, dest, region, cache)

    def shards(self, raw: bytes, regions: list[RegionPool]) -> Opened:
        """Open ``raw``: the shards of this rank's heads, and every decode pool of each of ``regions`` (this rank's
        region pools beside the target's); SharedKVAttachError when any is refused."""
        dest = decode_pb2.KVDestination.FromString(raw)
        with self._lock:
            opened = open_regions(dest, regions, self._attach_region)  # first: a region refused opens nothing
            return open_shards(dest, self._attach, self.cache, self.split.num_kv_heads, self.split.kv_range), opened

    def attach(self, aid: int, raw: bytes, regions: list[RegionPool]) -> Opened:
        """Open ``raw`` and keep it as ``aid`` (beyond ATTACHED_MAX the least recently used are dropped)."""
        opened = self.shards(raw, regions)
        with self._lock:
            self._attached[aid] = opened
            while len(self._attached) > ATTACHED_MAX:  # the least recently written (``attached`` touches)
                self._attached.popitem(last=False)
        return opened

    def attached(self, aid: int) -> Opened:
        with self._lock:
            opened = self._attached.get(aid)
            if opened is not None:  # a request still writing is never the one evicted
                self._attached.move_to_end(aid)
        if opened is None:
            raise ValueError(f"no destination attached as {aid} on this rank (kept: the {ATTACHED_MAX} last used)")
        return opened

    def settler(self, group) -> Settler:
        """Ranks 1..N-1: the thread that finishes this rank's shares and acknowledges them (made on first use)."""
        if self._settler is None:
            self._settler = Settler(Acks(group.store.port, group.size), group.rank)
        return self._settler


_RANK_POOLS: weakref.WeakKeyDictionary[object, RankPools] = weakref.WeakKeyDictionary()


def rank_pools(runner) -> RankPools:
    """The opened destinations of one rank's runner (made on first use)."""
    pools = _RANK_POOLS.get(runner)
    if pools is None:
        pools = _RANK_POOLS[runner] = RankPools(runner.kv_cache, runner.model.tp_split)
    return pools


def _header(sub: Sub, n: int = 0, m: int = 0, k: int = 0, a: int = 0, b: int = 0) -> torch.Tensor:
    return torch.tensor([Op.RANK_PAGES, sub, n, m, k, a, b, 0], dtype=torch.int64)


def _int64(raw: bytes) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.int64)


def _encode_dest(dest: decode_pb2.KVDestination | None) -> torch.Tensor:
    """A rank's own pool for the POOLS gather: [length, bytes...] padded to MAX_DEST_BYTES (length 0: none)."""
    raw = dest.SerializeToString(deterministic=True) if dest is not None and pool_kind(dest) is not None else b""
    if len(raw) > MAX_DEST_BYTES:
        raw = b""
    out = torch.zeros(1 + MAX_DEST_BYTES, dtype=torch.int64)
    out[0] = len(raw)
    out[1:1 + len(raw)] = _int64(raw) if raw else out[1:1]
    return out


def serve_op(runner, group, header: torch.Tensor) -> None:
    """Ranks 1..N-1: one RANK_PAGES sequence rank 0 announced (worker.serve). A failure to open is reported to rank
    0 through ATTACH's all-reduce, a failed write through the chunk's acknowledgement, never by leaving the loop."""
    sub, n, m, k, a, b = (int(x) for x in header[1:7].tolist())
    pools = rank_pools(runner)
    if sub == Sub.POOLS:
        own = runner.kv_destination
        if m:  # Mooncake: this rank's shard (and index keys) through its own engines at the host rank 0 hands over
            host = host_text(group.broadcast(torch.empty(m, dtype=torch.int64, device=group.device)).cpu())
            own = pools.mooncake.offer(runner.kv_cache, host, n, runner_regions(runner))
        group.gather_to_root(_encode_dest(own).to(group.device))
        return
    size = 2 * n if sub == Sub.WRITE else k + m
    payload = group.broadcast(torch.empty(size, dtype=torch.int64, device=group.device)).cpu()
    if sub == Sub.ATTACH:
        flag = torch.zeros(1, dtype=torch.int64)
        try:
            if k:
                pools.mooncake.start(host_text(payload[:k]), n)
            pools.attach(a, bytes(payload[k:].tolist()), runner_regions(runner))
        except (SharedKVAttachError, ValueError, OSError, RuntimeError) as e:
            log.warning("tensor-parallel rank %d cannot open the decode's pools: %s", group.rank, e)
            flag[0] = 1
        group.all_reduce(flag.to(group.device))
        return
    ids = payload.tolist()
    share: ShareWrite | BaseException
    try:  # started here, finished and acknowledged by the settler: this loop goes on with the next plan
        shards, regions = pools.attached(b)
        share = start_share(runner.kv_cache, runner.model.tp_split, shards, ids[:n], ids[n:], regions)
    except Exception as e:
        share = e
    pools.settler(group).put(a, share)


def _unlink(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


class ShardWrites:
    """Rank 0 of an instance (or a TP=1 instance's only rank): its ranks' pools for decode (``pools``), and
    page writes of every rank straight into a decode's pools (``attach``, ``start``, ``finish``)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.split: HeadSplit = runner.model.tp_split
        self.local = rank_pools(runner)
        self.on_pages: Callable[[int, int], None] | None = None
        """Called with (rank, page slices) after each chunk a rank wrote (a metric)."""
        self._offers: dict[tuple[str, int], decode_pb2.KVDestination | None] = {}
        """(Mooncake host or "", engines) -> the offer made for it (one collective sequence each, once)."""
        self._ids = itertools.count(1)
        """Attach ids and chunk sequence numbers (one counter: no two messages ever share one)."""
        self._acks: Acks | None = None

    @property
    def collective(self) -> bool:
        return self.split.tp_size > 1

    def offer(self, mooncake_host: str = "", engines: int = 1) -> decode_pb2.KVDestination | None:
        """Decode: the ShardedPool of every rank's own pool (shm / CUDA IPC, or with ``mooncake_host`` each
        rank's shard and its index-key pool registered with its own ``engines`` transfer engines there); None
        unless every rank has one (one collective sequence, the first time)."""
        key = (mooncake_host, engines)
        if key not in self._offers:
            self._offers[key] = self._pools(*key)
        return self._offers[key]

    def _pools(self, host: str, engines: int) -> decode_pb2.KVDestination | None:
        runner = self.runner
        own = (self.local.mooncake.offer(runner.kv_cache, host, engines, runner_regions(runner)) if host
               else runner.kv_destination)
        if not self.collective or own is None or not _plain(own):
            return None
        group = self.runner.group
        raw = host.encode()
        with self.runner._sequence(_header(Sub.POOLS, engines, len(raw)), _int64(raw) if raw else None):
            parts = [p.cpu() for p in group.gather_to_root(_encode_dest(own).to(group.device))]
        raws = [bytes(p[1:1 + int(p[0])].tolist()) for p in parts]
        if not all(raws):
            log.warning("a tensor-parallel rank's KV pool is not shared: prefills send page bytes instead")
            return None
        pools = [decode_pb2.KVDestination.FromString(r) for r in raws]
        files = [f for p in pools[1:] for f in shm_files(p)]  # each rank's KV pool and its index-key pool
        atexit.register(_unlink, files)  # a rank stopped by a signal (or SIGKILL) cannot remove its own files
        return sharded_destination(self.split, pools)

    def attach(self, dest: decode_pb2.KVDestination, mooncake: tuple[str, int] | None = None) -> Attached:
        """Worker thread: every rank opens ``dest``'s pools (and every decode pool of each replicated region its
        pages carry) and keeps them for the request's chunks (``mooncake``: (host, engines) every rank starts its
        transfer engines at first); raises SharedKVAttachError if any rank cannot, or (before any rank opens
        anything) if a region of the pages is not carried this way or decode offers another (check_regions)."""
        raw = dest.SerializeToString(deterministic=True)
        host, engines = mooncake or ("", 0)
        regions = runner_regions(self.runner)
        check_regions(dest, regions)
        aid = next(self._ids)
        if host:
            self.local.mooncake.start(host, engines)
        if not self.collective:
            return Attached.of(aid, self.local.shards(raw, regions))
        err: SharedKVAttachError | None = None
        flag = torch.zeros(1, dtype=torch.int64)
        hb = host.encode()
        opened: Opened = ([], [])
        with self.runner._sequence(_header(Sub.ATTACH, engines, len(raw), len(hb), aid), _int64(hb + raw)):
            try:
                opened = self.local.shards(raw, regions)
            except Exception as e:  # any failure: rank 0 still joins the all-reduce the other ranks wait in
                err = e if isinstance(e, SharedKVAttachError) else SharedKVAttachError("rank", f"rank 0: {e!r}")
                flag[0] = 1
            failed = int(self.runner.group.all_reduce(flag.to(self.runner.group.device)).item())
        if err is not None:
            raise err
        if failed:
            raise SharedKVAttachError("rank", f"{failed} of {self.split.tp_size} tensor-parallel ranks cannot open "
                                              "the decode's pools (their logs say why)")
        return Attached.of(aid, opened)

    def start(self, attached: Attached, src_blocks: list[int], dst_blocks: list[int]) -> ChunkWrite:
        """Engine thread: announce the chunk to every rank (the plan broadcast, no other collective) and start rank
        0's share; returns without waiting for any byte to land (``finish`` does)."""
        seq = next(self._ids)
        if self.collective:
            payload = torch.tensor(src_blocks + dst_blocks, dtype=torch.int64)
            with self.runner._sequence(_header(Sub.WRITE, len(src_blocks), 0, 0, seq, attached.id), payload):
                pass
        try:
            return ChunkWrite(seq, start_share(self.runner.kv_cache, self.split, attached.shards, src_blocks,
                                               dst_blocks, attached.regions), None)
        except Exception as e:  # raised by finish, after every other rank's share is accounted for
            return ChunkWrite(seq, None, e)

    def finish(self, w: ChunkWrite, deadline: float | None = None) -> None:
        """Worker thread: block until rank 0's share and every other rank's acknowledgement of ``w`` are in;
        TransferError when any rank's share failed (or a rank died, or stayed silent past ``deadline``, monotonic
        s, None: the group's timeout from now: then every rank is killed and the instance fails)."""
        with w.lock:
            mine, w.claimed = not w.claimed, True
        if mine:
            try:
                w.failure = self._finish(w, deadline)
            except Exception as e:  # a dead rank (RankDiedError), a silent one, the store gone
                w.failure = e if isinstance(e, TransferError) else TransferError(
                    f"tensor-parallel page writes of a chunk cannot be confirmed: {e}", grpc.StatusCode.UNAVAILABLE)
            finally:
                w.done.set()
        w.done.wait()
        if w.failure is not None:
            raise w.failure

    def _finish(self, w: ChunkWrite, deadline: float | None) -> TransferError | None:
        counts, errors = [0] * self.split.tp_size, []
        try:
            if w.own is not None:
                counts[0] = w.own.finish()
        except Exception as e:
            errors.append(f"rank 0: {e!r}")
        if w.error is not None:
            errors.append(f"rank 0: {w.error!r}")
        if self.collective:
            if self._acks is None:
                self._acks = Acks(self.runner.group.store.port, self.split.tp_size)
            try:
                counts[1:], more = self._acks.collect(w.seq, range(1, self.split.tp_size), self.runner._check,
                                                      deadline)
            except SilentRanks as e:  # their writes may land later, into blocks decode frees: they must not live
                raise self.runner.silent(e.ranks, str(e)) from e
            except EngineDeadError as e:  # a rank died on its own: the live ones' writes of this chunk must not
                raise self.runner.silent([], str(e)) from e  # land later either, so they go before decode frees
            errors += more
        if errors:
            return TransferError(f"{len(errors)} tensor-parallel rank(s) failed to write pages into decode's pools: "
                                 + "; ".join(errors), grpc.StatusCode.INTERNAL)
        if self.on_pages is not None:
            for r, c in enumerate(counts):
                if c:
                    self.on_pages(r, c)
        return None
