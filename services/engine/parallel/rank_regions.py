"""Page regions beside the target's in rank-to-rank page writes (shm / cuda-ipc / mooncake): DeepSeek-V3.2's index
keys.

Under tensor parallelism the index keys are replicated: the indexer is not split (models/deepseek.py), every rank
computes the same key per token and stores it in its own whole index-key pool (index_keys.py). A tensor-parallel
decode offers each rank's index-key pool beside that rank's KV shard (``RankPool.pool.index``: the rank's own
destination; shm / cuda-ipc: region_pools.with_region_pool; mooncake: registered with the rank's own transfer
engines, region_pools.offer_mooncake); a plain decode pool carries its one index-key pool beside it.

Every decode pool of the region must receive every page. At ATTACH rank 0 first checks, opening nothing, that
every decode pool offers its pool of each region, written the way its target pool is (mapped beside a mapped pool,
Mooncake beside a Mooncake one), naming this prefill's region and codec (``check_regions``; else
SharedKVAttachError, reason the region's kind, both regions named, and the pages go as bytes); then every writer
rank opens the region pool of every decode rank (shape checked: region_pools.attach_region_pool, or over Mooncake
a mooncake_ranks.RemoteRegion). Per chunk the writer ranks split the chunk's pages as the replicas of a head split
the target's (rank r takes share (r + first destination block) % tp, so with latent attention a rank writes the
index keys of the very pages whose latent it writes), and each writes its share into every decode rank's region
pool at the same block ids (a copy, or Mooncake batches submitted beside the target's), inside the share the
chunk's acknowledgement covers (rank_writes.start_share).

Only replicated regions are carried. A draft region (speculative decoding) never occurs at TP>1 (EngineConfig
refuses a draft model with tensor parallelism), so no rank split of it is defined: a rank write facing one (a TP=1
prefill with a draft, a tensor-parallel decode's pool) is refused, reason ``draft``, and the pages go as bytes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from services.common.kv_kinds import PoolKind, pool_kind
from services.common.pb import decode_pb2
from services.engine.kv_layout import Region
from services.engine.kv_transport import mooncake
from services.engine.parallel.mooncake_ranks import RemoteRegion, host_pool
from services.engine.parallel.split import HeadSplit
from services.engine.region_pools import POOL_FIELDS, RegionPool, copy_region, region_kind
from services.engine.shared_kv import SHM_DIR, SHM_NAME_RE, SharedKVAttachError

CARRIED = frozenset({"index"})
"""Region kinds rank writes carry: those every rank holds whole (replicated)."""


@dataclass(frozen=True)
class RegionShard:
    """One decode pool of a region beside the target's, opened by a writer rank."""

    kind: str
    """The region's kind (kv_layout.Region.kind)."""
    src: torch.Tensor
    """This rank's own pool of the region (blocks at dim 2)."""
    pool: torch.Tensor | RemoteRegion
    """A decode rank's pool of it (or a plain decode's): the same shape but for the block count (mapped here, or a
    decode rank's over Mooncake)."""


RegionOpener = Callable[[decode_pb2.KVDestination, Region, torch.Tensor], torch.Tensor | RemoteRegion]
"""Opens (decode pool, region, this rank's own pool of it) -> the decode's pool of the region, checked
(rank_pages.RankPools: mapped through region_pools.attach_region_pool, or a RemoteRegion over Mooncake)."""


def refused(regions: list[RegionPool]) -> SharedKVAttachError | None:
    """Why rank writes cannot carry ``regions`` (the first region refused names the reason), or None: a region kind
    that is not replicated."""
    for region, _ in regions:
        if region.kind not in CARRIED:
            return SharedKVAttachError(region.kind, f"the {region.kind} region is not carried by rank-to-rank shard "
                                                    f"writes (a tensor-parallel engine runs no draft model)")
    return None


def _rank_pools(dest: decode_pb2.KVDestination) -> list[decode_pb2.KVDestination]:
    """The decode pools ``dest`` names: each rank's pool of a ShardedPool, else the plain pool itself."""
    kind = pool_kind(dest)
    return [rp.pool for rp in dest.sharded.ranks] if kind is not None and kind.per_rank else [dest]


def check_regions(dest: decode_pb2.KVDestination, regions: list[RegionPool]) -> list[decode_pb2.KVDestination]:
    """The decode pools ``dest`` names, once rank writes carry ``regions`` (region, own pool) into them and each
    offers its pool of every one naming this prefill's region and codec (nothing opened: rank 0 checks this before
    it asks every rank to open the pools); else SharedKVAttachError (reason: the region's kind, naming the decode
    rank and both regions; ``device`` for a Mooncake landing area, whose slots hold every region)."""
    ranks = _rank_pools(dest)
    why = refused(regions)
    if why is not None:
        raise why
    for r, pool in enumerate(ranks):
        kind = pool_kind(pool)
        with _naming(r, len(ranks)):
            if kind is not None and kind.remote:
                host_pool(pool.mooncake)  # a landing area holds every region in its slots: reason device
            for region, _ in regions:
                region_kind(pool, region, _beside(kind))
    return ranks


def _beside(target: PoolKind | None) -> Callable[[PoolKind], bool]:
    """Which region pools rank writes fill beside a target pool of kind ``target``: mapped ones beside a mapped
    pool (shm, cuda-ipc), Mooncake ones (on its transfer engines) beside a Mooncake pool; none beside another."""
    if target is not None and target.remote:
        return lambda k: k.remote
    if target is not None and target.mapped:
        return lambda k: k.mapped
    return lambda k: False


def open_regions(dest: decode_pb2.KVDestination, regions: list[RegionPool], attach: RegionOpener
                 ) -> list[RegionShard]:
    """Open every decode pool's pool of each of this rank's ``regions`` (region, own pool) with ``attach``, after
    check_regions; SharedKVAttachError (reason: the region's kind) when one is refused, missing or of another
    shape."""
    out = []
    ranks = check_regions(dest, regions)
    for r, pool in enumerate(ranks):
        for region, cache in regions:
            with _naming(r, len(ranks)):
                out.append(RegionShard(region.kind, cache, attach(pool, region, cache)))
    return out


@contextlib.contextmanager
def _naming(rank: int, ranks: int) -> Iterator[None]:
    """A SharedKVAttachError raised inside names decode rank ``rank`` (of a ShardedPool of ``ranks``)."""
    try:
        yield
    except SharedKVAttachError as e:
        if ranks == 1:
            raise
        raise SharedKVAttachError(e.reason, f"decode rank {rank}: {e}") from e


def offers(dest: decode_pb2.KVDestination, regions: list[RegionPool]) -> bool:
    """Whether every pool ``dest`` names carries its pool of each of ``regions`` (decode's offer)."""
    return all(region.kind in POOL_FIELDS and pool.HasField(region.kind) for pool in _rank_pools(dest)
               for region, _ in regions)


def share(split: HeadSplit, dst_blocks: list[int]) -> tuple[int, int]:
    """[lo, hi) of a chunk's pages this rank writes into every region pool: tp_size even shares, turned by the first
    destination block (the target's replica rule, rank_writes.start_share)."""
    n, tp = len(dst_blocks), split.tp_size
    k = (split.rank + (dst_blocks[0] if dst_blocks else 0)) % tp
    return k * n // tp, (k + 1) * n // tp


def write_regions(split: HeadSplit, regions: list[RegionShard], src_blocks: list[int], dst_blocks: list[int]
                  ) -> list[tuple[object, int]]:
    """Start writing this rank's share of the chunk's pages into every region pool (the same block ids as the
    target's): a mapped pool is copied (a CUDA copy is only queued), a Mooncake one gets its batches submitted,
    which are returned in flight (mooncake.settle). ValueError for a block outside a pool; a failure settles the
    batches this call submitted before it raises."""
    lo, hi = share(split, dst_blocks)
    batches: list[tuple[object, int]] = []
    try:
        for r in regions if hi > lo else []:
            if isinstance(r.pool, RemoteRegion):
                batches += r.pool.write(src_blocks[lo:hi], dst_blocks[lo:hi])
            else:
                copy_region(r.src, src_blocks[lo:hi], r.pool, dst_blocks[lo:hi])
    except BaseException:
        mooncake.settle(batches)  # nothing of a failed start stays in flight
        raise
    return batches


def shm_files(dest: decode_pb2.KVDestination) -> list[str]:
    """Paths of the /dev/shm files behind a rank's own pool and its region pools (rank 0 removes them at exit)."""
    pools = [dest, *(getattr(dest, f) for f in POOL_FIELDS if dest.HasField(f))]
    return [os.path.join(SHM_DIR, p.shm.name) for p in pools if (k := pool_kind(p)) is not None and k.shm_file
            and SHM_NAME_RE.fullmatch(p.shm.name)]
