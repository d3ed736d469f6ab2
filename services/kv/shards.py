"""Tensor-parallel shard writes: every rank writes its KV heads straight into the decode ranks that hold them
(over shm, cuda-ipc or mooncake: engine/parallel/rank_pages.py and rank_writes.py), and its share of the pages of
DeepSeek-V3.2's index-key region into every decode rank's pool of it, over the same transport (rank_regions.py).
Used for a tensor-parallel decode's ``ShardedPool`` and for every side-transport write of a tensor-parallel
prefill."""

from __future__ import annotations

import asyncio
import logging

from services.common import kv_kinds
from services.common.kv_kinds import pool_id
from services.common.pb import decode_pb2, prefill_pb2
from services.engine.kv_pages import KVPages
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import PageWriter
from services.engine.parallel.rank_pages import MAX_TP, ShardWrites, pool_split, spec_of
from services.engine.parallel.rank_regions import offers, refused
from services.engine.parallel.rank_writes import Attached, ShardWriter
from services.engine.shared_kv import SharedKVAttachError
from services.kv.connector import Connector

log = logging.getLogger(__name__)


class ShardConnector(Connector):
    """Rank to rank. The transport each rank writes over is the destination's (``over``: its connector)."""

    name = "shards"
    pool = kv_kinds.SHARDED
    writes_pages_itself = True

    async def attach(self, shards: ShardWrites, request: prefill_pb2.PrefillRequest, over: Connector,
                     mooncake_host: str, mooncake_engines: int) -> Attached:
        """Every rank's pools opened (kept by every rank for the chunks); SharedKVAttachError to fall back."""
        dest = request.destination
        if len(dest.sharded.ranks) > MAX_TP:  # bounded before any per-rank work
            raise SharedKVAttachError("split", f"{len(dest.sharded.ranks)} rank pools (at most {MAX_TP})")
        moon = None
        if over.crosses_hosts:  # every rank pool is on the decode the stream goes to (ranks trust this)
            for pool in [dest] if dest.HasField("mooncake") else [rp.pool for rp in dest.sharded.ranks]:
                await asyncio.to_thread(mooncake.check_pool, pool.mooncake, request.decode_address)
            moon = (mooncake_host, mooncake_engines)
        return await asyncio.to_thread(shards.attach, dest, moon)

    @staticmethod
    def shard_writer(shards: ShardWrites, over: Connector, dest: decode_pb2.KVDestination, attached: Attached,
                     blocks: list[int]) -> PageWriter:
        split = shards.split
        return ShardWriter(shards, over.name, pool_id(dest), attached, blocks,
                           (spec_of(split), pool_split(dest, split.num_kv_heads)), over.overlaps_compute)

    def offer(self, pages: KVPages, mooncake_host: str = "", mooncake_engines: int = 1
              ) -> decode_pb2.KVDestination | None:
        """TP>1: every rank's own pool, each with its pool of every region beside the target's (index keys); with
        ``mooncake_host`` each rank's shard and region pools through its own transfer engines
        (parallel/mooncake_ranks.py). None (logged) when rank writes do not carry a region of the pages, or a rank's
        region pool is not shared."""
        regions = pages.region_pools
        why = refused(regions)
        if why is not None:
            log.warning("KV pool not offered (prefills send page bytes instead): %s", why)
            return None
        dest = pages.shard_writes().offer(mooncake_host, mooncake_engines) if mooncake_host else pages.destination
        if dest is not None and not offers(dest, regions):
            log.warning("KV pool not offered (prefills send page bytes instead): a tensor-parallel rank's %s pool is "
                        "not shared", "+".join(r.kind for r, _ in regions))
            return None
        return dest


SHARDS = ShardConnector()
