"""The prefill side of every connector: which one writes a request's pages, or none (bytes in the stream).

Decode advertises one pool (ReserveResponse.destination, forwarded by the router); the prefill takes it
when its ``--kv-transport`` is that transport (or ``auto``) and every check passes (the connector's
``probe``, then the pool's shape and the block ids, the same for every connector). Otherwise it falls back to
page bytes in the stream: counted per (transport, reason) and logged once for each.
"""

from __future__ import annotations

import logging
import threading

import torch

from services.common.kv_kinds import pool_kind
from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2
from services.engine.kv_layout import PageLayout
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.mooncake_staged import StagingRing
from services.engine.parallel.rank_pages import ShardWrites
from services.engine.region_pools import RegionPool
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools
from services.kv import registry
from services.kv.connector import Connector, Export, Plan
from services.kv.shards import SHARDS

log = logging.getLogger(__name__)


class InvalidDestinationError(ValueError):
    """The request's destination block ids do not fit the decode pool it names (INVALID_ARGUMENT)."""


class DirectWrites:
    def __init__(self, mode: str, metrics: PrefillMetrics, mooncake_host: str = "127.0.0.1",
                 staging_bytes: int = 2 << 30, mooncake_engines: int = 1) -> None:
        self.mode = mode
        """The configured transport: grpc (never writes directly), shm, cuda-ipc, mooncake or auto (whichever
        side transport decode offers)."""
        self.metrics = metrics
        self.pools = SharedKVPools()
        self.mooncake_host = mooncake_host
        self._mooncake: mooncake.MooncakeEngine | None = None
        self.mooncake_engines = mooncake_engines
        """Transfer engines this prefill spreads each chunk's writes over (with as many of decode's)."""
        self.staging_bytes = staging_bytes
        self._ring: StagingRing | None = None
        """Pinned host staging registered with Mooncake (made on the first write into a host landing area)."""
        self._lock = threading.Lock()  # attach() and the Mooncake start run in worker threads
        self._logged: set[tuple[str, str]] = set()
        self.regions: list[RegionPool] = []
        """(region, pool) of each page region beside the target's (index keys, draft KV): a side transport then also
        writes each into decode's pool of it (region_pools.py), or falls back."""
        self.shards: ShardWrites | None = None
        """This instance's rank-to-rank writes (set by the servicer): used for a tensor-parallel decode's pool,
        and for every side-transport write of a tensor-parallel prefill."""
        self.unavailable: dict[str, str] = {}
        """Transports this prefill does not write through, and why (its engine's loop in a process of its own:
        services/prefill/engine_port.py); an offer of one falls back to bytes in the stream (counted, logged)."""

    @property
    def modes(self) -> registry.Mode:
        """``mode`` as the registry reads it (which connectors it writes through)."""
        return registry.Mode(self.mode)

    def _fallback(self, transport: str, reason: str, message: str) -> None:
        self.metrics.kv_transport_fallbacks_total.labels(transport, reason).inc()
        if (transport, reason) not in self._logged:
            self._logged.add((transport, reason))
            log.warning("%s transport refused (%s): %s; sending page bytes in the stream (logged once per reason)",
                        transport, reason, message)

    def attach_pool(self, request: prefill_pb2.PrefillRequest) -> torch.Tensor:
        with self._lock:
            return self.pools.attach(request.destination)

    def mooncake_engine(self) -> mooncake.MooncakeEngine:
        with self._lock:
            if self._mooncake is None and self.shards is not None:
                # One set of engines per process: rank 0's (parallel/mooncake_ranks.py), which its rank writes use.
                self._mooncake = self.shards.local.mooncake.start(self.mooncake_host, self.mooncake_engines)
            if self._mooncake is None:
                why = mooncake.available()
                if why is not None:
                    raise SharedKVAttachError("unavailable", why)
                self._mooncake = mooncake.MooncakeEngine(self.mooncake_host, count=self.mooncake_engines)
            return self._mooncake

    def staging_ring(self, engine: mooncake.MooncakeEngine) -> StagingRing:
        with self._lock:
            if self._ring is None:
                self._ring = StagingRing(engine, self.staging_bytes)
            return self._ring

    def _connector(self, request: prefill_pb2.PrefillRequest, num_blocks: int
                   ) -> tuple[Connector, Connector, list[int]] | None:
        """(connector, transport it writes over, destination blocks) when this mode writes the offered pool, else
        None (counted as a fallback)."""
        offered = pool_kind(request.destination)
        # Rank to rank (rank_pages.py): a tensor-parallel decode's pools, or any write of a tensor-parallel prefill.
        ranks = self.shards is not None and (offered is SHARDS.pool or self.shards.collective)
        conn, over = registry.for_destination(request.destination, ranks)
        if conn is None or over is None or not self.modes.takes(over):
            self._fallback(self.mode, "none", f"the decode offers {offered.case if offered else 'no shared pool'}")
            return None
        if over.name in self.unavailable:
            self._fallback(over.name, "engine_core", self.unavailable[over.name])
            return None
        dest = list(request.dest_block_ids)
        if len(dest) != num_blocks:
            self._fallback(over.name, "blocks", f"{len(dest)} destination block ids for a {num_blocks}-block prompt")
            return None
        return conn, over, dest

    async def writer(self, request: prefill_pb2.PrefillRequest, src: torch.Tensor, num_blocks: int,
                     export: Export | None = None, wire: PageLayout | None = None) -> PageWriter | None:
        """A writer into the request's reserved blocks, or None (page bytes go in the stream).

        ``src`` is this prefill's KV cache; ``num_blocks`` the prompt's block count, which the request's
        dest_block_ids must match; ``export`` the engine's page export (codec, out), which stages pages for
        a decode that offers a host landing area (Mooncake with a device pool), which may then carry ``wire``
        (the negotiated wire codec's layout, if any; StagedWriter.carry): the staging fit counts its pages. Raises
        InvalidDestinationError for block ids outside decode's pool."""
        if self.modes.bytes_only:
            return None
        chosen = self._connector(request, num_blocks)
        if chosen is None:
            return None
        conn, over, dest = chosen
        if conn is SHARDS:  # index keys too; a region rank writes do not carry is refused at attach (its kind)
            return await self._shard_writer(request, over, dest)
        try:
            plan = await conn.probe(self, request, src, num_blocks, export, wire)
        except SharedKVAttachError as e:
            self._fallback(over.name, e.reason, str(e))
            return None
        if not self._fits(plan, src, dest, over):
            return None  # the fingerprint check would refuse the pages; never reinterpret them
        try:
            return await conn.writer(self, request, plan, src, export, dest)
        except SharedKVAttachError as e:
            self._fallback(over.name, e.reason, str(e))
            return None

    def _fits(self, plan: Plan, src: torch.Tensor, dest: list[int], over: Connector) -> bool:
        """Decode's pool holds pages of this cache's shape and dtype (else a fallback), and every destination
        block is inside it (else InvalidDestinationError)."""
        shape = plan.shape
        if shape[:2] != src.shape[:2] or shape[3:] != src.shape[3:] or plan.dtype != src.dtype:
            self._fallback(over.name, "shape", f"decode's pool is {shape} {plan.dtype}, this cache "
                                               f"{tuple(src.shape)} {src.dtype}")
            return False
        bad = next((b for b in dest if b >= shape[2]), None)
        if bad is not None:
            raise InvalidDestinationError(f"block {bad} is outside the decode pool's {shape[2]} blocks")
        return True

    async def _shard_writer(self, request: prefill_pb2.PrefillRequest, over: Connector, blocks: list[int]
                            ) -> PageWriter | None:
        """Every rank writes its KV heads straight into the decode ranks that hold them (shm / cuda-ipc / mooncake; a
        ShardedPool, or one plain pool written by this tensor-parallel prefill's ranks); see rank_pages.py."""
        assert self.shards is not None
        try:
            attached = await SHARDS.attach(self.shards, request, over, self.mooncake_host, self.mooncake_engines)
        except SharedKVAttachError as e:
            self._fallback(over.name, e.reason, str(e))
            return None
        bad = next((b for b in blocks if b >= attached.blocks), None)
        if bad is not None:
            raise InvalidDestinationError(f"block {bad} is outside the decode pool's {attached.blocks} blocks")
        return SHARDS.shard_writer(self.shards, over, request.destination, attached, blocks)
