"""``shm`` (CPU) and ``cuda-ipc`` (GPUs of one host): the prefill copies pages straight into a same-host
decode's pool, opened from its typed destination (engine/shared_kv.py, engine/kv_transport/shared_pool.py);
with more regions than the target's (index keys, draft KV), into decode's pools of them too
(engine/region_pools.py)."""

from __future__ import annotations

import asyncio

import torch

from services.common import kv_kinds
from services.common.kv_kinds import PoolKind, pool_id
from services.common.pb import decode_pb2, prefill_pb2
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import KVPages
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.shared_pool import SharedPoolWriter
from services.engine.region_pools import region_writer
from services.kv.connector import Connector, Export, Plan, PlanContext


class SharedPoolConnector(Connector):
    writes_pages_itself = True

    def __init__(self, pool: PoolKind) -> None:
        self.name = pool.transport
        self.pool = pool

    async def probe(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, src: torch.Tensor,
                    num_blocks: int, export: Export | None, wire: PageLayout | None) -> Plan:
        pool = await asyncio.to_thread(ctx.attach_pool, request)
        return Plan(tuple(pool.shape), pool.dtype, pool=pool)

    async def writer(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, plan: Plan, src: torch.Tensor,
                     export: Export | None, dest: list[int]) -> PageWriter:
        if ctx.regions:
            return await asyncio.to_thread(region_writer, ctx.pools, request.destination, ctx.regions, self.name,
                                           pool_id(request.destination), src, plan.pool, dest)
        return SharedPoolWriter(self.name, pool_id(request.destination), src, plan.pool, dest)

    def offer(self, pages: KVPages, *args: object) -> decode_pb2.KVDestination | None:
        """The engine's same-host pool (made with ``--kv-cache-shared``), with the pool of each other region the
        engine's pages carry (index keys, draft KV; a pool without them all is not offered then)."""
        dest = pages.destination
        if dest is not None and not all(dest.HasField(r.kind) for r, _ in pages.region_pools):
            return None
        return dest


SHM = SharedPoolConnector(kv_kinds.SHM)
CUDA_IPC = SharedPoolConnector(kv_kinds.CUDA_IPC)
