"""Choosing how a request's page bytes travel: a side transport that writes straight into the reserved
blocks of decode's pool (``shm``, ``cuda-ipc``, ``mooncake``), or bytes in the PushKV stream (``grpc``).

Decode advertises one pool (ReserveResponse.destination, forwarded by the router); the prefill takes it
when its ``--kv-transport`` is that transport (or ``auto``) and every check passes (see
services/engine/shared_kv.py and kv_transport/mooncake.py). Otherwise it falls back to page bytes in
the stream: counted per (transport, reason) and logged once for each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import torch

from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import PageExport
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.mooncake_staged import StagedWriter, StagingRing, codec_fits
from services.engine.kv_transport.shared_pool import ONEOF_OF, SharedPoolWriter
from services.engine.parallel.rank_pages import MAX_TP, ShardWrites, pool_split, spec_of, transport_of
from services.engine.parallel.rank_writes import ShardWriter
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools, pool_id
from services.engine.spec.pools import draft_writer, mooncake_draft

log = logging.getLogger(__name__)

TRANSPORT_OF = {oneof: name for name, oneof in ONEOF_OF.items()}
"""KVDestination.pool case -> the transport that writes into it."""


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
        self.draft = None
        """This prefill's draft (services/engine/spec SpecDecoder) when its pages carry a draft region: a side
        transport then also writes that region into decode's draft pool (spec/pools.py), or falls back."""
        self.shards: ShardWrites | None = None
        """This instance's rank-to-rank writes (set by the servicer): used for a tensor-parallel decode's pool,
        and for every side-transport write of a tensor-parallel prefill."""

    def _fallback(self, transport: str, reason: str, message: str) -> None:
        self.metrics.kv_transport_fallbacks_total.labels(transport, reason).inc()
        if (transport, reason) not in self._logged:
            self._logged.add((transport, reason))
            log.warning("%s transport refused (%s): %s; sending page bytes in the stream (logged once per reason)",
                        transport, reason, message)

    def _attach(self, request: prefill_pb2.PrefillRequest) -> torch.Tensor:
        with self._lock:
            return self.pools.attach(request.destination)

    def _engine(self) -> mooncake.MooncakeEngine:
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

    def _staging(self, engine: mooncake.MooncakeEngine) -> StagingRing:
        with self._lock:
            if self._ring is None:
                self._ring = StagingRing(engine, self.staging_bytes)
            return self._ring

    async def writer(self, request: prefill_pb2.PrefillRequest, src: torch.Tensor, num_blocks: int,
                     export: Callable[[list[int], str | None, torch.Tensor], PageExport] | None = None,
                     wire: PageLayout | None = None) -> PageWriter | None:
        """A writer into the request's reserved blocks, or None (page bytes go in the stream).

        ``src`` is this prefill's KV cache; ``num_blocks`` the prompt's block count, which the request's
        dest_block_ids must match; ``export`` the engine's page export (codec, out), which stages pages for
        a decode that offers a host landing area (Mooncake with a device pool), which may then carry ``wire``
        (the negotiated wire codec's layout, if any; StagedWriter.carry): the staging fit counts its pages. Raises
        InvalidDestinationError for block ids outside decode's pool."""
        if self.mode == "grpc":
            return None
        offered = request.destination.WhichOneof("pool")
        # Rank to rank (rank_pages.py): a tensor-parallel decode's pools, or any write of a tensor-parallel prefill.
        ranks = self.shards is not None and (offered == "sharded" or self.shards.collective)
        transport = transport_of(request.destination) if ranks else TRANSPORT_OF.get(offered or "", "")
        if not transport or (self.mode != "auto" and transport != self.mode):
            self._fallback(self.mode, "none", f"the decode offers {offered or 'no shared pool'}")
            return None
        dest = list(request.dest_block_ids)
        if len(dest) != num_blocks:
            self._fallback(transport, "blocks", f"{len(dest)} destination block ids for a {num_blocks}-block prompt")
            return None
        if ranks:
            return await self._shard_writer(request, dest)
        try:
            if transport == "mooncake":
                shape, dtype = await asyncio.to_thread(mooncake.check_pool, request.destination.mooncake,
                                                       request.decode_address)  # may resolve a host name
                staged = request.destination.mooncake.page_major
                if self.draft is not None and staged:
                    raise SharedKVAttachError("draft", "a host landing area carries the target region only")
                draft_plane = None if self.draft is None else await asyncio.to_thread(
                    mooncake_draft, request.destination, self.draft.region(), self.draft.kv_cache,
                    request.decode_address)  # the draft pool beside the target one (spec/pools.py)
                if src.is_cuda and not staged:
                    raise SharedKVAttachError("device", "this Mooncake build writes from host memory only and the "
                                                        "decode offers its pool, not a host landing area")
                page_bytes = src[:, :, 0].numel() * src.element_size()
                if wire is not None and codec_fits(wire, page_bytes):
                    page_bytes = wire.page_bytes
                if staged and (export is None or num_blocks * page_bytes > self.staging_bytes):
                    raise SharedKVAttachError("staging", f"{num_blocks} pages of {page_bytes} bytes do not fit the "
                                                         f"Mooncake staging ring ({self.staging_bytes} bytes)")
                engine = await asyncio.to_thread(self._engine)
                pool_shape, pool_dtype = shape, dtype
            else:
                pool = await asyncio.to_thread(self._attach, request)
                pool_shape, pool_dtype = tuple(pool.shape), pool.dtype
        except SharedKVAttachError as e:
            self._fallback(transport, e.reason, str(e))
            return None
        if pool_shape[:2] != src.shape[:2] or pool_shape[3:] != src.shape[3:] or pool_dtype != src.dtype:
            self._fallback(transport, "shape", f"decode's pool is {pool_shape} {pool_dtype}, this cache "
                                               f"{tuple(src.shape)} {src.dtype}")
            return None  # the fingerprint check would refuse the pages; never reinterpret them
        bad = next((b for b in dest if b >= pool_shape[2]), None)
        if bad is not None:
            raise InvalidDestinationError(f"block {bad} is outside the decode pool's {pool_shape[2]} blocks")
        if transport == "mooncake":
            try:
                if staged and export is not None:
                    ring = await asyncio.to_thread(self._staging, engine)
                    return StagedWriter(engine, ring, (src.shape[0], 2, *src.shape[3:]), src.dtype, export,
                                        request.destination, dest)
                return await asyncio.to_thread(mooncake.MooncakeWriter, engine, src, request.destination, dest,
                                               draft_plane)
            except SharedKVAttachError as e:
                self._fallback(transport, e.reason, str(e))
                return None
        if self.draft is not None:
            try:
                return await asyncio.to_thread(draft_writer, self.pools, request.destination, self.draft, transport,
                                               pool_id(request.destination), src, pool, dest)
            except SharedKVAttachError as e:
                self._fallback(transport, e.reason, str(e))
                return None
        return SharedPoolWriter(transport, pool_id(request.destination), src, pool, dest)

    async def _shard_writer(self, request: prefill_pb2.PrefillRequest, blocks: list[int]) -> PageWriter | None:
        """Every rank writes its KV heads straight into the decode ranks that hold them (shm / cuda-ipc / mooncake; a
        ShardedPool, or one plain pool written by this tensor-parallel prefill's ranks); see rank_pages.py."""
        assert self.shards is not None
        dest = request.destination
        transport = transport_of(dest)
        try:
            if len(dest.sharded.ranks) > MAX_TP:  # bounded before any per-rank work
                raise SharedKVAttachError("split", f"{len(dest.sharded.ranks)} rank pools (at most {MAX_TP})")
            moon = None
            if transport == "mooncake":  # every rank pool is on the decode the stream goes to (ranks trust this)
                for pool in [dest] if dest.HasField("mooncake") else [rp.pool for rp in dest.sharded.ranks]:
                    await asyncio.to_thread(mooncake.check_pool, pool.mooncake, request.decode_address)
                moon = (self.mooncake_host, self.mooncake_engines)
            attached = await asyncio.to_thread(self.shards.attach, dest, moon)  # kept by every rank for the chunks
        except SharedKVAttachError as e:
            self._fallback(transport, e.reason, str(e))
            return None
        bad = next((b for b in blocks if b >= attached.blocks), None)
        if bad is not None:
            raise InvalidDestinationError(f"block {bad} is outside the decode pool's {attached.blocks} blocks")
        split = self.shards.split
        return ShardWriter(self.shards, transport, pool_id(dest), attached, blocks,
                           (spec_of(split), pool_split(dest, split.num_kv_heads)))
