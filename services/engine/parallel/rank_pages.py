"""Pages rank to rank: side transports (shm on CPU, cuda-ipc on GPU, mooncake on host pools) between
tensor-parallel instances.

Decode: every rank's KV shard is its own shared pool; rank 0 collects them once (RANK_PAGES/POOLS: each
rank's KVDestination gathered to rank 0) into one typed ``ShardedPool`` that Reserve offers (rank r: KV
heads [a, b); a head held by several ranks is in each replica's pool).

Prefill: a request's destination (a ShardedPool, or one plain pool holding all heads) is opened by every
rank before the claim (RANK_PAGES/ATTACH; any rank failing means the pages go as bytes in the stream).
For each chunk rank 0 announces RANK_PAGES/WRITE (source and destination block ids, the destination);
every rank copies the intersection of its heads with each decode rank's heads straight into that rank's
pool (a head replicated on the prefill side: its replicas split the pages; replicated on the decode
side: written into every replica). The sequence ends with one all-reduce of the per-rank page counts:
when rank 0 holds it, every rank's writes of the chunk have landed (a CUDA rank synchronizes first), and
only then does rank 0 send the chunk's descriptor on the PushKV stream. No page passes through rank 0.

Over mooncake (mooncake_ranks.py) each rank uses its own transfer engines: rank 0 hands every rank the host
and engine count (POOLS on decode, ATTACH on prefill) and each rank starts its engines there.

Plan message: header [Op.RANK_PAGES, sub, pages n, destination bytes m, host bytes k, 0, 0, 0]; int64
payload WRITE: source block ids[n] | destination block ids[n] | destination bytes[m]; ATTACH: host
bytes[k] | destination bytes[m] (n: Mooncake engines; k = 0: no Mooncake); POOLS: host bytes[m] (n:
Mooncake engines; m = 0: each rank's own shm / CUDA IPC pool). The destination is KVDestination protobuf
bytes (parsed as that type, never code); the host is text (a name or address, never a path); a rank opens
nothing but what shared_kv's and mooncake's checks allow.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import logging
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from services.common.pb import decode_pb2
from services.engine.kv_layout import HeadSplitSpec
from services.engine.kv_transport.base import PageWriter, TransferError
from services.engine.kv_transport.shared_pool import check_blocks, copy_pages_peer
from services.engine.parallel.mooncake_ranks import RankMooncake, RemotePool, host_text, settle_writes
from services.engine.parallel.plan import Op
from services.engine.parallel.split import HeadSplit, TensorParallelError
from services.engine.shared_kv import SHM_DIR, SHM_NAME_RE, SharedKVAttachError, SharedKVPools, _runs, pool_id

log = logging.getLogger(__name__)

MAX_DEST_BYTES = 4096
"""Longest serialized per-rank KVDestination a rank hands rank 0 (a CUDA IPC pool is ~300 bytes)."""
MAX_TP = 64
"""Largest tensor-parallel size a ShardedPool may name."""
PLAIN_POOLS = {"shm": "shm", "cuda_ipc": "cuda-ipc", "mooncake": "mooncake"}
"""KVDestination.pool cases a rank's own pool may be -> the transport that writes it."""


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
    kind = dest.WhichOneof("pool")
    if kind == "sharded":
        inner = {rp.pool.WhichOneof("pool") for rp in dest.sharded.ranks}
        return PLAIN_POOLS.get(inner.pop(), "") if len(inner) == 1 else ""
    return PLAIN_POOLS.get(kind or "", "")


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
    if dest.WhichOneof("pool") == "sharded":
        sp = dest.sharded
        return HeadSplitSpec(sp.tp_size, max(1, num_kv_heads // max(1, sp.tp_size)), sp.kv_replicas)
    return HeadSplitSpec(1, num_kv_heads, 1)


@dataclass(frozen=True)
class Shard:
    heads: tuple[int, int]
    """[start, end) of the KV heads this pool holds."""
    pool: torch.Tensor | RemotePool
    """[layers, 2, blocks, block_size, end - start, head_dim] (mapped here, or a decode rank's over Mooncake)."""


def open_shards(dest: decode_pb2.KVDestination,
                attach: Callable[[decode_pb2.KVDestination], torch.Tensor | RemotePool],
                cache: torch.Tensor, num_kv_heads: int, heads: tuple[int, int] | None = None) -> list[Shard]:
    """Check a destination against this model and open its pools (``attach``: shared_kv's checked open), only
    those holding one of ``heads`` ([start, end), this rank's; None: all; a CUDA IPC open costs a context on
    the pool's device). Raises SharedKVAttachError (reason ``split``: a head split this prefill cannot write; ``shape``: a pool
    of another shape or dtype) so the pages go as bytes in the stream instead."""
    kind = dest.WhichOneof("pool")
    if kind in PLAIN_POOLS:
        shards = [Shard((0, num_kv_heads), attach(dest))]
    elif kind == "sharded":
        sp = dest.sharded
        if not 1 <= sp.tp_size <= MAX_TP or sp.num_kv_heads != num_kv_heads:
            raise SharedKVAttachError("split", f"decode's pool splits {sp.num_kv_heads} KV heads over {sp.tp_size} "
                                               f"ranks; this model has {num_kv_heads} KV heads")
        try:
            want = head_ranges(sp.tp_size, num_kv_heads)
        except TensorParallelError as e:
            raise SharedKVAttachError("split", f"decode's pool: {e}") from e
        got = [(rp.rank, rp.kv_head_start, rp.kv_head_end, rp.pool.WhichOneof("pool")) for rp in sp.ranks]
        if sp.kv_replicas != max(1, sp.tp_size // num_kv_heads) or len(got) != sp.tp_size or any(
                (r, a, b) != (i, *want[i]) or k not in PLAIN_POOLS for i, (r, a, b, k) in enumerate(got)):
            raise SharedKVAttachError("split", f"decode's pool names ranks/heads {[g[:3] for g in got]} with "
                                               f"{sp.kv_replicas} replicas; TP={sp.tp_size} over {num_kv_heads} KV "
                                               f"heads splits them as {want}")
        lo, hi = heads or (0, num_kv_heads)
        shards = [Shard(want[i], attach(rp.pool)) for i, rp in enumerate(sp.ranks)
                  if max(lo, want[i][0]) < min(hi, want[i][1])]
    else:
        raise SharedKVAttachError("none", f"the decode offers {kind or 'no shared pool'}")
    for sh in shards:
        p = sh.pool
        if (p.shape[:2] != cache.shape[:2] or p.shape[3] != cache.shape[3] or p.shape[5] != cache.shape[5]
                or p.shape[4] != sh.heads[1] - sh.heads[0] or p.dtype != cache.dtype):
            raise SharedKVAttachError("shape", f"decode's pool for KV heads {sh.heads} is {tuple(p.shape)} {p.dtype}; "
                                               f"this cache is {tuple(cache.shape)} {cache.dtype}")
    return shards


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


def write_share(cache: torch.Tensor, split: HeadSplit, shards: list[Shard], src_blocks: list[int],
                dst_blocks: list[int]) -> int:
    """This rank's part of a chunk: its heads' intersection with every shard, over its share of the pages
    (replicas of a head split the pages evenly; which replica takes the larger share turns with the first
    destination block, so one-page chunks do not all fall to one replica). Returns page slices written (a page
    into k shards: k); the writes have landed when it returns."""
    a, b = split.kv_range
    reps = split.kv_replicas
    k, n = (split.rank + (dst_blocks[0] if dst_blocks else 0)) % reps, len(src_blocks)
    lo, hi = k * n // reps, (k + 1) * n // reps
    written = 0
    batches: list[tuple[object, int]] = []
    try:
        for sh in shards if hi > lo else []:
            s, e = max(a, sh.heads[0]), min(b, sh.heads[1])
            if s < e:
                args = (src_blocks[lo:hi], (s - a, e - a), dst_blocks[lo:hi], (s - sh.heads[0], e - sh.heads[0]))
                if isinstance(sh.pool, RemotePool):
                    batches += sh.pool.write_heads(cache, *args)
                else:
                    copy_heads(cache, args[0], args[1], sh.pool, args[2], args[3])
                written += hi - lo
    finally:
        settle_writes(batches)  # nothing of this chunk is in flight once this returns
    for dev in {t.device for t in (cache, *(sh.pool for sh in shards))}:
        if dev.type == "cuda":  # the pages must have landed before rank 0 is told they have
            torch.cuda.current_stream(dev).synchronize()
    return written


class RankPools:
    """One rank's opened destinations (each decode pool mapped once, shared_kv.SharedKVPools)."""

    def __init__(self, cache: torch.Tensor, split: HeadSplit) -> None:
        self.cache = cache
        self.split = split
        self.pools = SharedKVPools()
        self.mooncake = RankMooncake()
        self._lock = threading.Lock()  # ATTACH runs in a worker thread, WRITE on the engine thread

    def _attach(self, dest: decode_pb2.KVDestination) -> torch.Tensor | RemotePool:
        if dest.WhichOneof("pool") == "mooncake":
            return self.mooncake.remote(dest, self.cache)
        return self.pools.attach(dest)

    def shards(self, raw: bytes) -> list[Shard]:
        dest = decode_pb2.KVDestination.FromString(raw)
        with self._lock:
            return open_shards(dest, self._attach, self.cache, self.split.num_kv_heads, self.split.kv_range)


_RANK_POOLS: weakref.WeakKeyDictionary[object, RankPools] = weakref.WeakKeyDictionary()


def rank_pools(runner) -> RankPools:
    """The opened destinations of one rank's runner (made on first use)."""
    pools = _RANK_POOLS.get(runner)
    if pools is None:
        pools = _RANK_POOLS[runner] = RankPools(runner.kv_cache, runner.model.tp_split)
    return pools


def _header(sub: Sub, n: int = 0, m: int = 0, k: int = 0) -> torch.Tensor:
    return torch.tensor([Op.RANK_PAGES, sub, n, m, k, 0, 0, 0], dtype=torch.int64)


def _int64(raw: bytes) -> torch.Tensor:
    return torch.tensor(list(raw), dtype=torch.int64)


def _encode_dest(dest: decode_pb2.KVDestination | None) -> torch.Tensor:
    """A rank's own pool for the POOLS gather: [length, bytes...] padded to MAX_DEST_BYTES (length 0: none)."""
    raw = dest.SerializeToString(deterministic=True) if dest is not None and dest.WhichOneof("pool") else b""
    if len(raw) > MAX_DEST_BYTES:
        raw = b""
    out = torch.zeros(1 + MAX_DEST_BYTES, dtype=torch.int64)
    out[0] = len(raw)
    out[1:1 + len(raw)] = _int64(raw) if raw else out[1:1]
    return out


def serve_op(runner, group, header: torch.Tensor) -> None:
    """Ranks 1..N-1: one RANK_PAGES sequence rank 0 announced (worker.serve). A failure to open or write is
    reported to rank 0 through the sequence's all-reduce, never by leaving the loop."""
    sub, n, m, k = (int(x) for x in header[1:5].tolist())
    if sub == Sub.POOLS:
        own = runner.kv_destination
        if m:  # Mooncake: this rank's shard through its own engines at the host rank 0 hands over
            host = host_text(group.broadcast(torch.empty(m, dtype=torch.int64, device=group.device)).cpu())
            own = rank_pools(runner).mooncake.offer(runner.kv_cache, host, n)
        group.gather_to_root(_encode_dest(own).to(group.device))
        return
    size = 2 * n + m if sub == Sub.WRITE else k + m
    payload = group.broadcast(torch.empty(size, dtype=torch.int64, device=group.device)).cpu()
    raw = bytes(payload[size - m:].tolist())
    split = runner.model.tp_split
    if sub == Sub.ATTACH:
        flag = torch.zeros(1, dtype=torch.int64)
        try:
            if k:
                rank_pools(runner).mooncake.start(host_text(payload[:k]), n)
            rank_pools(runner).shards(raw)
        except (SharedKVAttachError, ValueError, OSError, RuntimeError) as e:
            log.warning("tensor-parallel rank %d cannot open the decode's pools: %s", group.rank, e)
            flag[0] = 1
        group.all_reduce(flag.to(group.device))
        return
    counts = torch.zeros(group.size + 1, dtype=torch.int64)
    try:
        ids = payload[:2 * n].tolist()
        counts[group.rank] = write_share(runner.kv_cache, split, rank_pools(runner).shards(raw), ids[:n], ids[n:])
    except Exception as e:  # reported to rank 0, which fails the request; this rank keeps serving
        log.warning("tensor-parallel rank %d failed to write pages: %r", group.rank, e)
        counts[group.size] = 1
    group.all_reduce(counts.to(group.device))


def _unlink(paths: list[str]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


class ShardWrites:
    """Rank 0 of an instance (or a TP=1 instance's only rank): its ranks' pools for decode (``pools``), and
    page writes of every rank straight into a decode's pools (``attach``, ``write``)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.split: HeadSplit = runner.model.tp_split
        self.local = rank_pools(runner)
        self.on_pages: Callable[[int, int], None] | None = None
        """Called with (rank, page slices) after each chunk a rank wrote (a metric)."""
        self._offers: dict[tuple[str, int], decode_pb2.KVDestination | None] = {}
        """(Mooncake host or "", engines) -> the offer made for it (one collective sequence each, once)."""

    @property
    def collective(self) -> bool:
        return self.split.tp_size > 1

    def offer(self, mooncake_host: str = "", engines: int = 1) -> decode_pb2.KVDestination | None:
        """Decode: the ShardedPool of every rank's own pool (shm / CUDA IPC, or with ``mooncake_host`` each
        rank's shard registered with its own ``engines`` transfer engines there); None unless every rank has
        one (one collective sequence, the first time)."""
        key = (mooncake_host, engines)
        if key not in self._offers:
            self._offers[key] = self._pools(*key)
        return self._offers[key]

    def _pools(self, host: str, engines: int) -> decode_pb2.KVDestination | None:
        own = self.local.mooncake.offer(self.runner.kv_cache, host, engines) if host else self.runner.kv_destination
        if not self.collective or own is None or own.WhichOneof("pool") not in PLAIN_POOLS:
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
        files = [os.path.join(SHM_DIR, p.shm.name) for p in pools[1:] if p.WhichOneof("pool") == "shm"
                 and SHM_NAME_RE.fullmatch(p.shm.name)]
        atexit.register(_unlink, files)  # a rank stopped by a signal (or SIGKILL) cannot remove its own file
        return sharded_destination(self.split, pools)

    def attach(self, dest: decode_pb2.KVDestination, mooncake: tuple[str, int] | None = None) -> int:
        """Worker thread: every rank opens ``dest``'s pools (``mooncake``: (host, engines) every rank starts its
        transfer engines at first); raises SharedKVAttachError if any rank cannot. Returns the blocks of the
        smallest pool (a destination block id must be below it)."""
        raw = dest.SerializeToString(deterministic=True)
        host, engines = mooncake or ("", 0)
        if host:
            self.local.mooncake.start(host, engines)
        if not self.collective:
            return min(sh.pool.shape[2] for sh in self.local.shards(raw))
        err: SharedKVAttachError | None = None
        flag = torch.zeros(1, dtype=torch.int64)
        hb = host.encode()
        with self.runner._sequence(_header(Sub.ATTACH, engines, len(raw), len(hb)), _int64(hb + raw)):
            try:
                blocks = min(sh.pool.shape[2] for sh in self.local.shards(raw))
            except Exception as e:  # any failure: rank 0 still joins the all-reduce the other ranks wait in
                err = e if isinstance(e, SharedKVAttachError) else SharedKVAttachError("rank", f"rank 0: {e!r}")
                flag[0] = 1
            failed = int(self.runner.group.all_reduce(flag.to(self.runner.group.device)).item())
        if err is not None:
            raise err
        if failed:
            raise SharedKVAttachError("rank", f"{failed} of {self.split.tp_size} tensor-parallel ranks cannot open "
                                              "the decode's pools (their logs say why)")
        return blocks

    def write(self, raw: bytes, src_blocks: list[int], dst_blocks: list[int]) -> None:
        """Engine thread: every rank writes its heads of ``src_blocks`` into ``dst_blocks`` of the pools of the
        destination ``raw`` (KVDestination bytes); returns once all of them have landed."""
        counts = torch.zeros(self.split.tp_size + 1, dtype=torch.int64)
        failure: Exception | None = None
        if not self.collective:
            counts[0] = write_share(self.runner.kv_cache, self.split, self.local.shards(raw), src_blocks, dst_blocks)
        else:
            payload = torch.cat([torch.tensor(src_blocks + dst_blocks, dtype=torch.int64), _int64(raw)])
            with self.runner._sequence(_header(Sub.WRITE, len(src_blocks), len(raw)), payload):
                try:
                    counts[0] = write_share(self.runner.kv_cache, self.split, self.local.shards(raw), src_blocks,
                                            dst_blocks)
                except Exception as e:  # raised after the sequence (every rank must finish its all-reduce)
                    failure, counts[self.split.tp_size] = e, 1
                counts = self.runner.group.all_reduce(counts.to(self.runner.group.device)).cpu()
        failed = int(counts[self.split.tp_size])
        if failed:
            raise TransferError(f"{failed} tensor-parallel rank(s) failed to write pages into decode's pools"
                                f"{f': {failure!r}' if failure is not None else ''}", grpc.StatusCode.INTERNAL)
        if self.on_pages is not None:
            for r, c in enumerate(counts[:self.split.tp_size].tolist()):
                if c:
                    self.on_pages(r, c)


class ShardWriter(PageWriter):
    """One request's writer: every rank writes its heads straight into the decode ranks' pools."""

    def __init__(self, writes: ShardWrites, dest: decode_pb2.KVDestination, dest_blocks: list[int],
                 writer_split: HeadSplitSpec, pool: HeadSplitSpec) -> None:
        self.transport = transport_of(dest)
        self.pool_id = pool_id(dest)
        self.writes = writes
        self.raw = dest.SerializeToString(deterministic=True)
        self.dest = dest_blocks
        self.sender = None
        self.splits = (writer_split, pool)

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        self.writes.write(self.raw, src_blocks, self.dest[first_block:first_block + len(src_blocks)])
        return None
