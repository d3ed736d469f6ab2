"""The decode side's choice of what to offer prefills at Reserve: one connector's pool, or none.

Side transports (shm, cuda-ipc, mooncake, shard writes) write pages straight into this decode's pool; which
one decode offers follows from how it runs (``--kv-mooncake-host``, ``--kv-cache-shared``, tensor
parallelism, pools of other page regions), each connector making its own offer (its ``offer``).
"""

from __future__ import annotations

import logging

from services.common.kv_kinds import pool_id
from services.common.pb import decode_pb2
from services.engine.kv_pages import KVPages
from services.engine.kv_transport.mooncake_staged import HostLanding
from services.engine.shared_kv import SharedKVAttachError
from services.kv.mooncake import offer_mooncake_pool
from services.kv.shards import SHARDS
from services.kv.shared_pool import SHM

log = logging.getLogger(__name__)


def offered_pool(pages: KVPages, mooncake_host: str, mooncake_engines: int = 1) -> decode_pb2.KVDestination | None:
    """The pool this decode offers side transports: registered with Mooncake when ``mooncake_host`` is
    set (any host may write; a device pool through a pinned host landing area, kv_transport/mooncake_staged;
    with ``mooncake_engines`` transfer engines, all offered), else the engine's same-host shm / CUDA IPC pool,
    else None."""
    if pages.sharded:  # TP>1: every rank's own pool (and its index-key pool), written rank to rank (rank_pages.py)
        return SHARDS.offer(pages, mooncake_host, mooncake_engines)
    if pages.region_pools and not mooncake_host:  # more pools, offered with the target pool (index, draft)
        return SHM.offer(pages)
    if mooncake_host:
        try:
            return offer_mooncake_pool(pages, mooncake_host, mooncake_engines)
        except SharedKVAttachError as e:
            log.warning("KV pool not offered over Mooncake (prefills send page bytes instead): %s", e)
            if pages.region_pools:
                return None
    return SHM.offer(pages)  # the same-host pool, whichever kind the engine made (shm or cuda-ipc)


def landing_for(pages: KVPages, pool: str) -> HostLanding | None:
    """The host landing area behind offered pool ``pool`` (a Mooncake-registered host copy of a device pool),
    where a writer puts pages that are imported as each chunk's descriptor lands; None without one."""
    return next((e for e in pages.exporters if isinstance(e, HostLanding) and pool_id(e.destination) == pool), None)
