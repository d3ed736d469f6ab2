"""What every KV connector is: one way a request's pages travel from prefill's pool to decode's.

A connector has a **prefill side** (``probe`` a request's destination, then make the ``PageWriter`` that
writes and flushes each chunk's pages and releases their source at the last one) and a **decode side**
(``offer`` a destination at Reserve, ``accept`` a chunk once its descriptor checked out). What every
connector shares stays out of them: the claim (services/kv/claim.py), the layout fingerprint and the CRC
checks (services/decode/kv_receiver.py), the descriptor stream and its KVPoll states
(services/engine/kv_transport/base.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from services.common.kv_kinds import PoolKind
from services.common.pb import decode_pb2, prefill_pb2
from services.engine.async_engine import EngineFront
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import KVPages, PageExport
from services.engine.kv_transport.base import PageWriter
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools

Export = Callable[[list[int], str | None, torch.Tensor], PageExport]
"""The engine's page export (block ids, codec, out): what a connector that stages pages reads through."""


@dataclass
class Plan:
    """A request's destination as one connector's ``probe`` found it: the pool's shape and dtype (checked against
    this prefill's cache by the planner, the same for every connector) and what ``writer`` needs."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pool: torch.Tensor | None = None
    """An opened same-host pool (shm / cuda-ipc)."""
    engine: object = None
    """The Mooncake transfer engines writing it."""
    extras: list = field(default_factory=list)
    """(own pool, decode's Mooncake pool) of each region beside the target's (engine/region_pools.py), if written."""


class PlanContext(Protocol):
    """What the prefill's planner (services/kv/planner.py) lends a connector: opened pools, started engines."""

    regions: list
    """(region, own pool) of each page region beside the target's (engine/region_pools.RegionPool)."""
    pools: SharedKVPools
    staging_bytes: int

    def attach_pool(self, request: prefill_pb2.PrefillRequest) -> torch.Tensor: ...

    def mooncake_engine(self) -> object: ...

    def staging_ring(self, engine: object) -> object: ...


class Connector:
    """One transport, both sides. The flags are what the rest of the tree decides on instead of its name."""

    name: str = ""
    """The transport's name: ``--kv-transport``, ``KVChunk.transport``, ``KVClaim.transport``, metric labels."""
    pool: PoolKind | None = None
    """The kind of pool (``KVDestination.pool`` case, services/common/kv_kinds.py) decode offers for it (None:
    none)."""
    writes_pages_itself: bool = False
    """Pages land in decode's pool before their descriptor is sent: the stream opens with a claim and its
    chunks carry descriptors only (no payload)."""
    overlaps_compute: bool = False
    """Its writers only start a chunk's transfer on the engine thread and finish it in a worker
    (``PageWriter.overlaps_compute``): a chunk moves while the next one computes."""
    needs_host_staging: bool = False
    """Pages go through pinned host memory on both sides (a staging ring, a landing area on decode)."""
    crosses_hosts: bool = False
    """It writes over the network into memory decode registered: every pool it is offered must sit on the decode
    the stream goes to (checked per destination, off the event loop); same-host connectors check the host id."""

    # --- prefill side ---

    async def probe(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, src: torch.Tensor,
                    num_blocks: int, export: Export | None, wire: PageLayout | None) -> Plan:
        """Check the request's destination and get ready to write it; SharedKVAttachError (the fallback reason)
        when this connector cannot write it."""
        raise SharedKVAttachError("none", f"{self.name} writes no pages itself")

    async def writer(self, ctx: PlanContext, request: prefill_pb2.PrefillRequest, plan: Plan, src: torch.Tensor,
                     export: Export | None, dest: list[int]) -> PageWriter:
        """The request's writer into blocks ``dest`` of the pool ``plan`` found; SharedKVAttachError to fall back."""
        raise SharedKVAttachError("none", f"{self.name} writes no pages itself")

    # --- decode side ---

    def offer(self, pages: KVPages, *args: object) -> decode_pb2.KVDestination | None:
        """The destination this decode offers prefills for this connector (None: nothing to offer)."""
        return None

    def accept(self, engine: EngineFront, block_ids: list[int], layout: PageLayout, payload: bytes | memoryview,
               landing: object = None) -> Awaitable[None] | None:
        """One checked chunk's pages into the pool (None: they are there already)."""
        return None
