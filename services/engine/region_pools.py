"""Page regions beyond the target's over side transports (shm, cuda-ipc, mooncake): decode shares the pool of each
such region (DeepSeek-V3.2's index keys, speculative decoding's draft KV) beside its target pool, and a prefill
writes every region of every page straight into the reserved blocks (same block ids in every pool); over
``mooncake`` (any host) decode registers those pools with the transfer engines that serve its target pool and
offers them as ``DraftPool.mooncake``, and the prefill's MooncakeWriter writes each page's regions at the same block
id (host pools; a device pool is offered as a host landing area whose every slot holds a whole page of every region,
kv_transport/mooncake_staged.py, so its region pools are not offered on their own). Tensor-parallel rank writes
over shm / cuda-ipc carry the index keys too, into every decode rank's pool of them (parallel/rank_regions.py).

Decode: ``KVDestination.index`` / ``KVDestination.draft`` (a DraftPool: the region pool's shm file, CUDA IPC handle
or Mooncake pool, and the region as decode's layout names it, ``region_name``) ride in the destination Reserve
offers. Prefill: a writer whose pages carry such regions opens each pool too, after checking the offered region
names its own (identity, shape, codec) and the pool's shape and dtype equal its own pool's; any mismatch or a
missing pool is a SharedKVAttachError whose reason is the region's kind (the prefill then sends every region as
page bytes). In place, the pools' bytes are copied as they are: K/V regions in the caches' own dtypes (the draft
codec applies to page bytes on the wire and in the kvstore), index keys in their stored codec; the stream's
descriptors still carry the layout fingerprint naming every region and codec, which decode checks against its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.common.kv_kinds import PoolKind, pool_kind
from services.common.pb import decode_pb2
from services.engine.kv_layout import Region
from services.engine.kv_transport.mooncake import MooncakeEngine, check_pool, export_pool, segments_of
from services.engine.kv_transport.shared_pool import SharedPoolWriter, copy_pages_peer
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools, copy_pages

RegionPool = tuple[Region, torch.Tensor]
"""(a page region other than the target's, the pool that holds it with the target pool's block ids at dim 2)."""

POOL_FIELDS = ("index", "draft")
"""KVDestination fields of the region pools, by Region.kind."""


def runner_regions(runner) -> list[RegionPool]:
    """(region, pool) of each page region beside the target's that a model runner (of an engine, or of one
    tensor-parallel rank) holds, in layout order: DeepSeek-V3.2's index keys, then a draft's KV; empty for a
    target-only page."""
    pools: list[RegionPool] = []
    if runner.index_keys is not None:
        pools.append((runner.index_keys.region(), runner.index_keys.kv_cache))
    if runner.spec is not None:
        pools.append((runner.spec.region(), runner.spec.kv_cache))
    return pools


def region_name(region: Region) -> str:
    """How DraftPool.region names a region: its name (kind, identity and shape), then its codec."""
    return f"{region.name}:{region.codec}"


def _field(region: Region) -> str:
    """The KVDestination field that offers ``region``'s pool."""
    if region.kind not in POOL_FIELDS:
        raise SharedKVAttachError(region.kind, f"no pool field for a {region.kind!r} region (known: {POOL_FIELDS})")
    return region.kind


def with_region_pool(dest: decode_pb2.KVDestination, pool: decode_pb2.KVDestination, region: Region
                     ) -> decode_pb2.KVDestination:
    """``dest`` (the target pool) with ``region``'s pool ``pool`` (shm or cuda_ipc) in its field (index, draft)."""
    out = decode_pb2.KVDestination()
    out.CopyFrom(dest)
    kind = pool_kind(pool)
    if kind is None or not kind.mapped:
        raise SharedKVAttachError(region.kind, f"a {region.kind} pool is offered over shm or cuda-ipc only, "
                                               f"not {kind.case if kind else None}")
    field = getattr(out, _field(region))
    getattr(field, kind.case).CopyFrom(getattr(pool, kind.case))
    field.region = region_name(region)
    return out


def attach_region_pool(pools: SharedKVPools, dest: decode_pb2.KVDestination, region: Region, cache: torch.Tensor
                       ) -> torch.Tensor:
    """Open decode's pool of ``region`` from ``dest`` for a writer whose own pool of it is ``cache``;
    SharedKVAttachError (reason: the region's kind) when it is missing or differs."""
    kind = region_kind(dest, region, lambda k: k.mapped)
    inner = decode_pb2.KVDestination()
    getattr(inner, kind.case).CopyFrom(getattr(getattr(dest, _field(region)), kind.case))
    pool = pools.attach(inner)
    _check_shape(tuple(pool.shape), pool.dtype, cache, region.kind)
    return pool


def region_kind(dest: decode_pb2.KVDestination, region: Region, writes: Callable[[PoolKind], bool]) -> PoolKind:
    """Which pool ``dest`` offers for ``region``, when this transport ``writes`` that kind and it names ``region``
    (this writer's own); else SharedKVAttachError (reason: the region's kind) naming both regions."""
    field = _field(region)
    kind = pool_kind(getattr(dest, field)) if dest.HasField(field) else None
    if kind is None or not writes(kind):
        raise SharedKVAttachError(region.kind, f"the decode offers no {region.kind} pool beside its KV pool that "
                                               f"this transport writes ({kind.case if kind else 'none'}; pages with "
                                               f"a {region.kind} region go as bytes)")
    ours, theirs = region_name(region), getattr(dest, field).region
    if theirs != ours:
        raise SharedKVAttachError(region.kind, f"the decode's {region.kind} region is {theirs!r}, this prefill's "
                                               f"{ours!r}")
    return kind


def _check_shape(shape: tuple[int, ...], dtype: torch.dtype, cache: torch.Tensor, kind: str) -> None:
    """A pool of ``shape`` / ``dtype`` holds ``cache``'s pages (all but the block count equal)."""
    if shape[:2] != tuple(cache.shape[:2]) or shape[3:] != tuple(cache.shape[3:]) or dtype != cache.dtype:
        raise SharedKVAttachError(kind, f"the decode's {kind} pool is {shape} {dtype}, this prefill's {kind} "
                                        f"cache {tuple(cache.shape)} {cache.dtype}")


def offer_mooncake(engine: MooncakeEngine, dest: decode_pb2.KVDestination, regions: list[RegionPool]
                   ) -> decode_pb2.KVDestination:
    """Decode: ``dest`` (its target pool over Mooncake, export_pool) with each region pool registered with the same
    engines beside it (``DraftPool.mooncake``; blocking). SharedKVAttachError for a device pool or a landing area
    (a device pool's regions travel in its landing slots, mooncake_staged.HostLanding)."""
    out = decode_pb2.KVDestination()
    out.CopyFrom(dest)
    for region, cache in regions:
        if cache.is_cuda or dest.mooncake.page_major:
            raise SharedKVAttachError(region.kind, f"a {region.kind} pool beside a device KV pool travels in its "
                                                   "Mooncake landing slots (HostLanding), not as a pool of its own")
        field = getattr(out, _field(region))
        field.mooncake.CopyFrom(export_pool(engine, cache).mooncake)
        field.region = region_name(region)
    return out


def mooncake_region(dest: decode_pb2.KVDestination, region: Region, cache: torch.Tensor, decode_address: str
                    ) -> tuple[torch.Tensor, decode_pb2.MooncakePool]:
    """Prefill: the (own pool, decode's pool) of ``region`` a MooncakeWriter also fills, once the offered pool names
    this prefill's ``region``, sits on the target pool's transfer engines (same sessions, so on the decode the
    stream goes to: check_pool, blocking when the host is a name), has the target pool's block count and holds
    ``cache``'s pages; else SharedKVAttachError (reason: the region's kind)."""
    region_kind(dest, region, lambda k: k.remote)
    kind = region.kind
    pool = getattr(dest, _field(region)).mooncake
    if segments_of(pool) != segments_of(dest.mooncake) or pool.page_major:
        raise SharedKVAttachError(kind, f"the decode's {kind} pool is not registered with its KV pool's transfer "
                                        f"engines ({segments_of(pool)} vs {segments_of(dest.mooncake)})")
    try:
        shape, dtype = check_pool(pool, decode_address)
    except SharedKVAttachError as e:
        raise SharedKVAttachError(kind, f"the decode's {kind} pool: {e}") from e
    if shape[2] != dest.mooncake.shape[2]:
        raise SharedKVAttachError(kind, f"the decode's {kind} pool has {shape[2]} blocks, its KV pool "
                                        f"{dest.mooncake.shape[2]}")
    _check_shape(shape, dtype, cache, kind)
    return cache, pool


class RegionPoolWriter(SharedPoolWriter):
    """A SharedPoolWriter that also copies each page's other regions into decode's pools of them (same block
    ids); all have landed when ``write`` returns."""

    def __init__(self, transport: str, pool_id: str, src: torch.Tensor, pool: torch.Tensor, dest_blocks: list[int],
                 extras: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__(transport, pool_id, src, pool, dest_blocks)
        self.extras = extras
        """(this prefill's pool, decode's pool) of each region beside the target's."""

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        dest = self.dest[first_block:first_block + len(src_blocks)]
        for src, pool in self.extras:
            copy_region(src, src_blocks, pool, dest)
        return super().write(first_block, src_blocks)  # the target region; synchronizes a CUDA copy


def copy_region(src: torch.Tensor, src_blocks: list[int], pool: torch.Tensor, dst_blocks: list[int]) -> None:
    """pool[:, :, dst_blocks[i]] = src[:, :, src_blocks[i]] for a region's pools (blocks at dim 2): across GPUs one
    gather-copy-scatter (copy_pages_peer), else one copy per run of blocks (copy_pages); ValueError, before any
    byte moves, for a block outside either pool. A CUDA copy is only queued (the caller waits for it)."""
    bad = next((b for b in dst_blocks if not 0 <= b < pool.shape[2]), None)
    if bad is not None:
        raise ValueError(f"destination block {bad} is outside a region pool's {pool.shape[2]} blocks")
    if pool.device != src.device:
        copy_pages_peer(src, src_blocks, pool, dst_blocks)
    else:
        copy_pages(src, src_blocks, pool, dst_blocks)


def region_writer(pools: SharedKVPools, dest: decode_pb2.KVDestination, regions: list[RegionPool], transport: str,
                  pool_id: str, src: torch.Tensor, pool: torch.Tensor, dest_blocks: list[int]) -> RegionPoolWriter:
    """The writer of a prefill whose pages carry ``regions`` besides the target into decode's target ``pool`` and
    the region pools ``dest`` offers (blocking: opens them); SharedKVAttachError as attach_region_pool."""
    extras = [(cache, attach_region_pool(pools, dest, region, cache)) for region, cache in regions]
    return RegionPoolWriter(transport, pool_id, src, pool, dest_blocks, extras)
