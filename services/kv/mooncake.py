"""``mooncake`` (any host): the Mooncake Transfer Engine writes pages into decode's registered memory.

Two connectors under one transport name: **direct** (decode offers its CPU pool itself; the prefill writes
from its own host pool, engine/kv_transport/mooncake.py) and **staged** (decode's pool is on a GPU: it offers a
pinned host landing area, the prefill stages pages through a pinned ring, engine/kv_transport/mooncake_staged.py).
Decode says which by ``MooncakePool.page_major``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable

import torch

from services.common import kv_kinds
from services.common.pb import decode_pb2, prefill_pb2
from services.engine.async_engine import EngineFront
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import KVPages
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.mooncake_staged import (
    HostLanding,
    StagedWriter,
    check_landing,
    codec_fits,
    slot_of,
)
from services.engine.region_pools import mooncake_region, offer_mooncake
from services.engine.shared_kv import SharedKVAttachError
from services.kv.connector import Connector, Export, Plan, PlanContext

log = logging.getLogger(__name__)


class MooncakeConnector(Connector):
    """Direct: from this prefill's host pool into decode's registered CPU pool (and its other regions' pools)."""

    name = kv_kinds.MOONCAKE.transport
    pool = kv_kinds.MOONCAKE
    writes_pages_itself = True
    overlaps_compute = True
    crosses_hosts = True

    async def probe(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, src: torch.Tensor,
                    num_blocks: int, export: Export | None, wire: PageLayout | None) -> Plan:
        shape, dtype = await asyncio.to_thread(mooncake.check_pool, request.destination.mooncake,
                                               request.decode_address)  # may resolve a host name
        extras = [await asyncio.to_thread(mooncake_region, request.destination, region, cache, request.decode_address)
                  for region, cache in ctx.regions]  # the other regions' pools beside the target one (region_pools)
        if src.is_cuda:
            raise SharedKVAttachError("device", "this Mooncake build writes from host memory only and the "
                                                "decode offers its pool, not a host landing area")
        engine = await asyncio.to_thread(ctx.mooncake_engine)
        return Plan(shape, dtype, engine=engine, extras=extras)

    async def writer(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, plan: Plan, src: torch.Tensor,
                     export: Export | None, dest: list[int]) -> PageWriter:
        return await asyncio.to_thread(mooncake.MooncakeWriter, plan.engine, src, request.destination, dest,
                                       plan.extras)

    def offer(self, pages: KVPages, engine: mooncake.MooncakeEngine) -> decode_pb2.KVDestination | None:
        """The engine's own CPU pool registered with ``engine`` (every region's pool on the same engines)."""
        dest = mooncake.export_pool(engine, pages.pool)
        return offer_mooncake(engine, dest, pages.region_pools) if pages.region_pools else dest


class StagedMooncakeConnector(MooncakeConnector):
    """Staged: prefill pages -> pinned staging ring -> decode's pinned landing area -> decode's device pool. A page
    carries every region of the layout (index keys, draft KV after the target's): each landing slot holds one whole
    page (engine/kv_transport/mooncake_staged.py)."""

    needs_host_staging = True

    async def probe(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, src: torch.Tensor,
                    num_blocks: int, export: Export | None, wire: PageLayout | None) -> Plan:
        shape, dtype = await asyncio.to_thread(mooncake.check_pool, request.destination.mooncake,
                                               request.decode_address)  # may resolve a host name
        regions = [region for region, _ in ctx.regions]
        # Decode's slots must hold this prefill's pages: the same regions (names, codecs), the same bytes.
        page_bytes = check_landing(request.destination.mooncake, (src.shape[0], 2, *src.shape[3:]), src.dtype, regions)
        if wire is not None and codec_fits(wire, page_bytes, regions):
            page_bytes = wire.page_bytes
        if export is None or num_blocks * page_bytes > ctx.staging_bytes:
            raise SharedKVAttachError("staging", f"{num_blocks} pages of {page_bytes} bytes do not fit the "
                                                 f"Mooncake staging ring ({ctx.staging_bytes} bytes)")
        engine = await asyncio.to_thread(ctx.mooncake_engine)
        return Plan(shape, dtype, engine=engine)

    async def writer(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, plan: Plan, src: torch.Tensor,
                     export: Export | None, dest: list[int]) -> PageWriter:
        ring = await asyncio.to_thread(ctx.staging_ring, plan.engine)
        return StagedWriter(plan.engine, ring, (src.shape[0], 2, *src.shape[3:]), src.dtype, export,
                            request.destination, dest, [region for region, _ in ctx.regions])

    def offer(self, pages: KVPages, engine: mooncake.MooncakeEngine) -> decode_pb2.KVDestination | None:
        """A pinned host landing area mirroring the engine's device pool and its other regions' pools, a whole page
        a slot (this Mooncake build moves host memory only); kept alive with the engine's exporters."""
        regions = [region for region, _ in pages.region_pools]
        pool = pages.pool
        _, slot = slot_of((pool.shape[0], 2, *pool.shape[3:]), pool.dtype, regions)
        page = math.prod(pages.page_shape) * torch.empty((), dtype=pages.dtype).element_size()
        if slot != page:  # a slot holds a page exactly as the page API imports it (checked before registering)
            raise SharedKVAttachError("shape", f"landing slots of {slot} bytes for pages of {page} bytes")
        landing = HostLanding(engine, pool, pages.import_pages, regions)
        pages.exporters.append(landing)
        return landing.destination

    def accept(self, engine: EngineFront, block_ids: list[int], layout: PageLayout, payload: bytes | memoryview,
               landing: object = None) -> Awaitable[None] | None:
        """Engine thread: the chunk's pages from their landing slots into the device pool."""
        if landing is None or not block_ids:
            return None
        return engine.call(landing.land, block_ids, layout)


MOONCAKE = MooncakeConnector()
MOONCAKE_STAGED = StagedMooncakeConnector()


def offer_mooncake_pool(pages: KVPages, host: str, engines: int) -> decode_pb2.KVDestination | None:
    """Start ``engines`` transfer engines at ``host`` serving this decode's pool (kept as long as the pages
    live) and offer the pool through them: directly, or through a landing area for a device pool. Raises
    SharedKVAttachError when Mooncake is not loadable or an engine does not start."""
    why = mooncake.available()
    if why is not None:
        raise SharedKVAttachError("unavailable", why)
    engine = mooncake.MooncakeEngine(host, count=engines)
    pages.exporters.append(engine)  # the engine serves the registered pool as long as it lives
    # A device pool: one landing area, each slot a whole page of every region; host pools are registered themselves.
    return (MOONCAKE_STAGED if pages.pool.is_cuda else MOONCAKE).offer(pages, engine)
