"""The draft KV region over side transports (shm, cuda-ipc): decode shares its draft pool beside its target
pool, and a same-host prefill writes both regions of every page straight into the reserved blocks.

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

import torch

from services.common.pb import decode_pb2
from services.engine.kv_layout import Region
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
    kind = draft.WhichOneof("pool")
    if kind not in ("shm", "cuda_ipc"):
        raise SharedKVAttachError("draft", f"a draft pool is offered over shm or cuda-ipc only, not {kind}")
    getattr(out.draft, kind).CopyFrom(getattr(draft, kind))
    out.draft.region = region_name(region)
    return out


def attach_draft_pool(pools: SharedKVPools, dest: decode_pb2.KVDestination, region: Region,
                      draft_cache: torch.Tensor) -> torch.Tensor:
    """Open decode's draft pool from ``dest`` for a writer whose draft region is ``region`` and whose draft
    cache is ``draft_cache``; SharedKVAttachError (reason "draft") when it is missing or differs."""
    if not dest.HasField("draft") or dest.draft.WhichOneof("pool") is None:
        raise SharedKVAttachError("draft", "the decode offers no draft pool beside its KV pool (pages with a "
                                           "draft region go as bytes)")
    ours = region_name(region)
    if dest.draft.region != ours:
        raise SharedKVAttachError("draft", f"the decode's draft region is {dest.draft.region!r}, this prefill's "
                                           f"{ours!r}")
    kind = dest.draft.WhichOneof("pool")
    inner = decode_pb2.KVDestination()
    getattr(inner, kind).CopyFrom(getattr(dest.draft, kind))
    pool = pools.attach(inner)
    if tuple(pool.shape[:2]) != tuple(draft_cache.shape[:2]) or tuple(pool.shape[3:]) != tuple(draft_cache.shape[3:]) \
            or pool.dtype != draft_cache.dtype:
        raise SharedKVAttachError("draft", f"the decode's draft pool is {tuple(pool.shape)} {pool.dtype}, this "
                                           f"prefill's draft cache {tuple(draft_cache.shape)} {draft_cache.dtype}")
    return pool


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
