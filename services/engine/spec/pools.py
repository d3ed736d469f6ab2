"""The draft KV region over side transports (shm, cuda-ipc): decode shares its draft pool beside its target
pool, and a same-host prefill writes both regions of every page straight into the reserved blocks; over ``mooncake`` (any host) decode registers its
draft pool with the transfer engines that serve its target pool and offers it as ``DraftPool.mooncake``, and
the prefill's MooncakeWriter writes each page's draft region at the same block id (host pools only: a device
pool's landing area carries the target region alone, so such a decode offers no pool with a draft region).

Decode: ``KVDestination.draft`` (a DraftPool: the draft pool's shm file or CUDA IPC handle, and the draft
region as decode's layout names it) rides in the destination Reserve offers. Prefill: a writer for a
request with a draft region opens that pool too, after checking the region names the prefill's own draft
(identity, shape, codec) and the pool's shape and dtype equal its draft cache; any mismatch or a missing
draft pool is a SharedKVAttachError (the prefill then sends both regions as page bytes). In place, both
regions land in the caches' own dtypes (the draft codec applies to page bytes on the wire and in the
kvstore); the stream's descriptors still carry the layout fingerprint naming every region and codec,
which decode checks against its own.
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


def region_name(region: Region) -> str:
    """How DraftPool.region names a draft region: its name (draft identity and shape), then its codec."""
    return f"{region.name}:{region.codec}"


def with_draft_pool(dest: decode_pb2.KVDestination, draft: decode_pb2.KVDestination, region: Region
                    ) -> decode_pb2.KVDestination:
    """``dest`` (the target pool) with the draft pool ``draft`` (shm or cuda_ipc) and its region in ``draft``."""
    out = decode_pb2.KVDestination()
    out.CopyFrom(dest)
    kind = pool_kind(draft)
    if kind is None or not kind.mapped:
        raise SharedKVAttachError("draft", f"a draft pool is offered over shm or cuda-ipc only, "
                                           f"not {kind.case if kind else None}")
    getattr(out.draft, kind.case).CopyFrom(getattr(draft, kind.case))
    out.draft.region = region_name(region)
    return out


def attach_draft_pool(pools: SharedKVPools, dest: decode_pb2.KVDestination, region: Region,
                      draft_cache: torch.Tensor) -> torch.Tensor:
    """Open decode's draft pool from ``dest`` for a writer whose draft region is ``region`` and whose draft
    cache is ``draft_cache``; SharedKVAttachError (reason "draft") when it is missing or differs."""
    kind = _draft_kind(dest, region, lambda k: k.mapped)
    inner = decode_pb2.KVDestination()
    getattr(inner, kind.case).CopyFrom(getattr(dest.draft, kind.case))
    pool = pools.attach(inner)
    _check_shape(tuple(pool.shape), pool.dtype, draft_cache)
    return pool


def _draft_kind(dest: decode_pb2.KVDestination, region: Region, writes: Callable[[PoolKind], bool]) -> PoolKind:
    """Which pool ``dest.draft`` offers, when this transport ``writes`` that kind and it names ``region`` (this
    writer's own draft region); else SharedKVAttachError (reason "draft") naming both regions."""
    kind = pool_kind(dest.draft) if dest.HasField("draft") else None
    if kind is None or not writes(kind):
        raise SharedKVAttachError("draft", f"the decode offers no draft pool beside its KV pool that this transport "
                                           f"writes ({kind.case if kind else 'none'}; pages with a draft region go "
                                           f"as bytes)")
    ours = region_name(region)
    if dest.draft.region != ours:
        raise SharedKVAttachError("draft", f"the decode's draft region is {dest.draft.region!r}, this prefill's "
                                           f"{ours!r}")
    return kind


def _check_shape(shape: tuple[int, ...], dtype: torch.dtype, draft_cache: torch.Tensor) -> None:
    """A draft pool of ``shape`` / ``dtype`` holds ``draft_cache``'s pages (all but the block count equal)."""
    if shape[:2] != tuple(draft_cache.shape[:2]) or shape[3:] != tuple(draft_cache.shape[3:]) \
            or dtype != draft_cache.dtype:
        raise SharedKVAttachError("draft", f"the decode's draft pool is {shape} {dtype}, this "
                                           f"prefill's draft cache {tuple(draft_cache.shape)} {draft_cache.dtype}")


def offer_mooncake(engine: MooncakeEngine, dest: decode_pb2.KVDestination, draft_cache: torch.Tensor,
                   region: Region) -> decode_pb2.KVDestination:
    """Decode: ``dest`` (its target pool over Mooncake, export_pool) with the draft pool registered with the same
    engines beside it (``DraftPool.mooncake``; blocking). SharedKVAttachError for a device draft pool."""
    if draft_cache.is_cuda or dest.mooncake.page_major:
        raise SharedKVAttachError("draft", "a device KV pool's Mooncake landing area carries the target region only")
    out = decode_pb2.KVDestination()
    out.CopyFrom(dest)
    out.draft.mooncake.CopyFrom(export_pool(engine, draft_cache).mooncake)
    out.draft.region = region_name(region)
    return out


def mooncake_draft(dest: decode_pb2.KVDestination, region: Region, draft_cache: torch.Tensor,
                   decode_address: str) -> tuple[torch.Tensor, decode_pb2.MooncakePool]:
    """Prefill: the (draft cache, decode's draft pool) a MooncakeWriter also fills, once the offered draft pool
    names this prefill's draft ``region``, sits on the target pool's transfer engines (same sessions, so on the
    decode the stream goes to: check_pool, blocking when the host is a name), has the target pool's block count
    and holds ``draft_cache``'s pages; else SharedKVAttachError (reason "draft")."""
    _draft_kind(dest, region, lambda k: k.remote)
    pool = dest.draft.mooncake
    if segments_of(pool) != segments_of(dest.mooncake) or pool.page_major:
        raise SharedKVAttachError("draft", "the decode's draft pool is not registered with its KV pool's transfer "
                                           f"engines ({segments_of(pool)} vs {segments_of(dest.mooncake)})")
    try:
        shape, dtype = check_pool(pool, decode_address)
    except SharedKVAttachError as e:
        raise SharedKVAttachError("draft", f"the decode's draft pool: {e}") from e
    if shape[2] != dest.mooncake.shape[2]:
        raise SharedKVAttachError("draft", f"the decode's draft pool has {shape[2]} blocks, its KV pool "
                                           f"{dest.mooncake.shape[2]}")
    _check_shape(shape, dtype, draft_cache)
    return draft_cache, pool


class DraftPoolWriter(SharedPoolWriter):
    """A SharedPoolWriter that also copies each page's draft region into decode's draft pool (same block ids);
    both have landed when ``write`` returns."""

    def __init__(self, transport: str, pool_id: str, src: torch.Tensor, pool: torch.Tensor, dest_blocks: list[int],
                 draft_src: torch.Tensor, draft_pool: torch.Tensor) -> None:
        super().__init__(transport, pool_id, src, pool, dest_blocks)
        self.draft_src = draft_src
        self.draft_pool = draft_pool

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        dest = self.dest[first_block:first_block + len(src_blocks)]
        bad = next((b for b in dest if not 0 <= b < self.draft_pool.shape[2]), None)
        if bad is not None:
            raise ValueError(f"destination block {bad} is outside the draft pool's {self.draft_pool.shape[2]} blocks")
        if self.draft_pool.device != self.draft_src.device:
            copy_pages_peer(self.draft_src, src_blocks, self.draft_pool, dest)
        else:
            copy_pages(self.draft_src, src_blocks, self.draft_pool, dest)
        return super().write(first_block, src_blocks)  # the target region; synchronizes a CUDA copy


def draft_writer(pools: SharedKVPools, dest: decode_pb2.KVDestination, spec, transport: str, pool_id: str,
                 src: torch.Tensor, pool: torch.Tensor, dest_blocks: list[int]) -> DraftPoolWriter:
    """The writer of a prefill with a draft region (``spec``: its SpecDecoder) into decode's target ``pool``
    and the draft pool ``dest`` offers (blocking: opens the pool); SharedKVAttachError as attach_draft_pool."""
    draft_pool = attach_draft_pool(pools, dest, spec.region(), spec.kv_cache)
    return DraftPoolWriter(transport, pool_id, src, pool, dest_blocks, spec.kv_cache, draft_pool)
