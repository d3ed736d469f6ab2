"""Rank to rank over Mooncake: tensor-parallel instances whose ranks move KV heads through their own transfer
engines (host pools only: this Mooncake build moves host memory).

Decode: every rank starts its own engine(s) at the decode's ``--kv-mooncake-host`` (rank 0 hands the host and
the engine count to the others in the RANK_PAGES/POOLS sequence), registers its KV shard and describes it as
a ``MooncakePool``; rank 0 offers them together as a ``ShardedPool`` (rank_pages.sharded_destination), rank r
holding the heads [a, b) it holds in its own pool.

Prefill: every rank starts its own engine(s) at the prefill's host (handed over in RANK_PAGES/ATTACH) and
registers its own cache; a decode rank's pool is a :class:`RemotePool` (its shape and dtype checked as
mooncake.check_pool does; rank 0 has already checked every segment is on the decode the stream goes to).
A rank writes the intersection of its heads with a decode rank's heads: when both sides hold exactly those
heads, a run of consecutive blocks is one contiguous range per (layer, K|V) on both sides; when the decode
rank's shard is whole but the writer holds more heads (a lower prefill TP, e.g. (1, 2)), the slice is first
gathered into registered staging bytes in the shard's layout (one range per (layer, K|V) and piece of the
run); otherwise (the shard holds more heads than the writer sends, e.g. (2, 1)) each token's slice of heads
is its own range (head_dim x heads contiguous, token rows strided).

Regions beside the target's that every rank holds whole (DeepSeek-V3.2's index keys, rank_regions.CARRIED): a
decode rank registers its pool of each with the engines that serve its shard and offers it in the rank's
``KVDestination.index`` (region_pools.offer_mooncake, as a plain Mooncake decode does); a writer rank sees each
decode rank's one as a :class:`RemoteRegion` (region_pools.mooncake_region's checks) and writes its share of a
chunk's pages into it, one range per (layer, plane) and run of blocks, submitted with its target writes and settled
with them before the chunk is acknowledged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
import torch

from services.common.pb import decode_pb2
from services.engine.kv_layout import Region
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.base import TransferError
from services.engine.kv_transport.shared_pool import check_blocks
from services.engine.region_pools import RegionPool, mooncake_region, offer_mooncake
from services.engine.shared_kv import SharedKVAttachError, _runs

log = logging.getLogger(__name__)

MAX_HOST_BYTES = 255
"""Longest host name a rank is handed (DNS names are at most 253 characters)."""
STAGING_BYTES = 64 << 20
"""Host bytes a writer rank registers once (when it first gathers a head slice) to send slices as whole shards."""


class Staging:
    """A writer rank's registered gather buffer; held (``lock``) from the gather until its transfers settled."""

    def __init__(self, engine: mooncake.MooncakeEngine) -> None:
        self.buf = torch.empty(STAGING_BYTES, dtype=torch.uint8)
        self.base = engine.register(self.buf)
        self.lock = threading.Lock()


class RankMooncake:
    """One rank's transfer engines (started once, at the first host handed to it) and what it registered."""

    def __init__(self) -> None:
        self.engine: mooncake.MooncakeEngine | None = None
        self._staging: Staging | None = None
        self._lock = threading.Lock()

    def start(self, host: str, count: int) -> mooncake.MooncakeEngine:
        """This rank's engines at ``host`` (blocking; started on the first call, later calls reuse them)."""
        with self._lock:
            if self.engine is None:
                why = mooncake.available()
                if why is not None:
                    raise SharedKVAttachError("unavailable", why)
                if not host or len(host) > MAX_HOST_BYTES:
                    raise SharedKVAttachError("host", f"no valid Mooncake host for this rank ({host!r})")
                self.engine = mooncake.MooncakeEngine(host, count=max(1, count))
            return self.engine

    def offer(self, cache: torch.Tensor, host: str, count: int, regions: list[RegionPool] | None = None
              ) -> decode_pb2.KVDestination | None:
        """Decode rank: its own shard registered with its engines, as a MooncakePool, with its pool of each of
        ``regions`` (index keys) registered with the same engines beside it; None (logged) when any cannot be (no
        Mooncake here, a device cache)."""
        try:
            engine = self.start(host, count)
            dest = mooncake.export_pool(engine, cache)
            return offer_mooncake(engine, dest, regions) if regions else dest
        except SharedKVAttachError as e:
            log.warning("this tensor-parallel rank's KV shard is not offered over Mooncake: %s", e)
            return None

    def remote(self, dest: decode_pb2.KVDestination, cache: torch.Tensor) -> RemotePool:
        """Prefill rank: a decode rank's Mooncake pool (``dest.mooncake``), checked, for writes from ``cache`` (this
        rank's, registered here: a device cache is refused now, at attach, so the pages go as bytes)."""
        if self.engine is None:
            raise SharedKVAttachError("unavailable", "this rank started no Mooncake transfer engine")
        if cache.is_cuda:
            raise SharedKVAttachError("device", "this Mooncake build writes from host memory only; this rank's KV "
                                                "cache is on a device")
        self.engine.register(cache)
        return RemotePool(self.engine, dest.mooncake, self.staging)

    def region(self, dest: decode_pb2.KVDestination, region: Region, cache: torch.Tensor) -> RemoteRegion:
        """Prefill rank: a decode rank's (or a plain decode's) Mooncake pool of ``region`` beside its target pool
        ``dest.mooncake``, checked, for writes from ``cache`` (this rank's own pool of it); SharedKVAttachError
        (reason: the region's kind; ``device`` for a device cache or a landing area)."""
        if self.engine is None:
            raise SharedKVAttachError("unavailable", "this rank started no Mooncake transfer engine")
        host_pool(dest.mooncake)
        if cache.is_cuda:
            raise SharedKVAttachError("device", f"this Mooncake build writes from host memory only; this rank's "
                                                f"{region.kind} pool is on a device")
        return RemoteRegion(self.engine, dest, region, cache)

    def staging(self) -> Staging:
        """This rank's gather buffer (allocated and registered on first use)."""
        with self._lock:
            if self._staging is None:
                assert self.engine is not None
                self._staging = Staging(self.engine)
            return self._staging


class RemotePool:
    """A decode rank's registered pool [layers, 2, blocks, block_size, heads, head_dim] as a writer rank sees it."""

    def __init__(self, engine: mooncake.MooncakeEngine, pool: decode_pb2.MooncakePool,
                 staging: Callable[[], Staging]) -> None:
        host_pool(pool)
        # The segments' host is checked against the decode's address by rank 0 (services/kv/shards.py); here against
        # itself: shape, dtype, size and ports.
        self.shape, self.dtype = mooncake.check_pool(pool, mooncake._host(pool.segment))
        self.engine = engine
        self.segments = mooncake.segments_of(pool)
        self.base = pool.base_address
        self.staging = staging
        self.device = torch.device("cpu")
        """Where the pool's bytes are (host memory, written by the transfer engine; nothing to synchronize)."""

    def gathers(self, src_heads: tuple[int, int], dst_heads: tuple[int, int], src: torch.Tensor) -> bool:
        """Whether write_heads sends this slice through the staging buffer, blocking until it has landed (the whole
        shard, a slice of the writer's heads: e.g. (1, 2)); otherwise it only submits."""
        return dst_heads[1] - dst_heads[0] == self.shape[4] and src_heads[1] - src_heads[0] != src.shape[4]

    def write_heads(self, src: torch.Tensor, src_blocks: list[int], src_heads: tuple[int, int],
                    dst_blocks: list[int], dst_heads: tuple[int, int]) -> list[tuple[object, int]]:
        """Start writing src[:, :, src_blocks[i], :, a:b] into this pool's [:, :, dst_blocks[i], :, c:d]; returns
        the transfer batches in flight (mooncake.settle; none when it ``gathers``: written when it returns). Block
        ids are checked against both pools."""
        (a, b), (c, d) = src_heads, dst_heads
        assert b - a == d - c > 0
        check_blocks(src_blocks, src.shape[2], "source")
        check_blocks(dst_blocks, self.shape[2], "destination")
        layers, _, nb_src, bs, h_src, hd = src.shape
        nb_dst, h_dst = self.shape[2], self.shape[4]
        elt = src.element_size()
        row_src, row_dst = h_src * hd * elt, h_dst * hd * elt  # one token's heads (bytes)
        src_base = self.engine.register(src)
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        if self.gathers(src_heads, dst_heads, src):
            self._write_gathered(src, src_blocks, src_heads, dst_blocks)
            return []
        whole = (b - a) == h_src and (d - c) == h_dst  # both sides hold exactly these heads
        for s, t, n in _runs(src_blocks, dst_blocks):
            for plane in range(layers * 2):
                so = src_base + (plane * nb_src + s) * bs * row_src
                do = self.base + (plane * nb_dst + t) * bs * row_dst
                if whole:
                    srcs.append(so)
                    dsts.append(do)
                    lens.append(n * bs * row_src)
                    continue
                for row in range(n * bs):
                    srcs.append(so + row * row_src + a * hd * elt)
                    dsts.append(do + row * row_dst + c * hd * elt)
                    lens.append((b - a) * hd * elt)
        return self.engine.submit(self.segments, srcs, dsts, lens) if srcs else []


    def _write_gathered(self, src: torch.Tensor, src_blocks: list[int], heads: tuple[int, int],
                        dst_blocks: list[int]) -> None:
        """Blocking: gather src[:, :, run, :, a:b] piece by piece into the staging bytes (the shard's layout, so
        one range per (layer, K|V) and piece) and write each piece before the next gather reuses the bytes."""
        a, b = heads
        layers, _, _, bs, _, hd = src.shape
        planes = layers * 2
        block_bytes = bs * (b - a) * hd * src.element_size()  # one block of one plane, equal on both sides
        if planes * block_bytes > STAGING_BYTES:
            raise ValueError(f"one page slice ({planes * block_bytes} bytes) exceeds the staging buffer")
        per = STAGING_BYTES // (planes * block_bytes)  # blocks per piece
        stage = self.staging()
        with stage.lock:
            for s, t, n in _runs(src_blocks, dst_blocks):
                for i in range(0, n, per):
                    k = min(per, n - i)
                    view = stage.buf[:planes * k * block_bytes].view(src.dtype).view(layers, 2, k, bs, b - a, hd)
                    view.copy_(src[:, :, s + i:s + i + k, :, a:b])
                    srcs = [stage.base + p * k * block_bytes for p in range(planes)]
                    dsts = [self.base + (p * self.shape[2] + t + i) * block_bytes for p in range(planes)]
                    settle_writes(self.engine.submit(self.segments, srcs, dsts, [k * block_bytes] * planes))


class RemoteRegion:
    """A decode pool of a region every rank holds whole (index keys: [layers, planes, blocks, ...], the target pool's
    block ids) as a writer rank sees it, on the engines of the target pool beside it (region_pools.mooncake_region:
    the region's name and codec, the segments, the block count, the shape and dtype)."""

    def __init__(self, engine: mooncake.MooncakeEngine, dest: decode_pb2.KVDestination, region: Region,
                 cache: torch.Tensor) -> None:
        # The target pool's segments are on the decode the stream goes to (checked by rank 0); the region's equal them.
        _, pool = mooncake_region(dest, region, cache, dest.mooncake.segment)
        self.engine = engine
        self.segments = mooncake.segments_of(pool)
        self.plane = mooncake.PoolPlane(engine, cache, pool)
        """Both pools' registered bases and one (layer, plane) block's bytes (the MooncakeWriter's own)."""
        self.shape = tuple(int(x) for x in pool.shape)
        self.device = torch.device("cpu")
        """Where the pool's bytes are (host memory, written by the transfer engine; nothing to synchronize)."""

    def write(self, src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[object, int]]:
        """Start writing this rank's pool of the region at ``src_blocks`` into the decode's at ``dst_blocks`` (one
        range per run of blocks and (layer, plane)); returns the transfer batches in flight (mooncake.settle). Block
        ids are checked against both pools before anything is submitted."""
        p = self.plane
        check_blocks(src_blocks, p.src_blocks, "source")
        check_blocks(dst_blocks, p.dst_blocks, "destination")
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for s, t, n in _runs(src_blocks, dst_blocks):
            for r in range(p.regions):
                srcs.append(p.src_base + (r * p.src_blocks + s) * p.region_bytes)
                dsts.append(p.dst_base + (r * p.dst_blocks + t) * p.region_bytes)
                lens.append(n * p.region_bytes)
        return self.engine.submit(self.segments, srcs, dsts, lens) if srcs else []


def host_pool(pool: decode_pb2.MooncakePool) -> None:
    """SharedKVAttachError (reason ``device``) unless ``pool`` is a host pool ranks write into: a landing area
    (page major) of a device pool is written by the staged writer only."""
    if pool.page_major:
        raise SharedKVAttachError("device", "a decode rank's Mooncake pool is a host landing area (page major); "
                                            "ranks write only into host pools")


def host_text(payload: torch.Tensor) -> str:
    """A host name rank 0 handed over (bytes as int64; undecodable bytes are replaced, never run)."""
    return bytes(int(x) & 0xFF for x in payload[:MAX_HOST_BYTES + 1].tolist()).decode("utf-8", "replace")


def settle_writes(batches: list[tuple[object, int]]) -> None:
    """Block until every batch of this rank's chunk has landed; TransferError on a failed one."""
    rc = mooncake.settle(batches)
    if rc != 0:
        raise TransferError(f"a Mooncake write into a decode rank's pool failed (rc={rc})",
                            grpc.StatusCode.UNAVAILABLE)
