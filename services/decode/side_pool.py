"""The pool this decode offers side transports, and the claim a side-transport stream opens with.

Side transports (shm, cuda-ipc, mooncake) write pages straight into this decode's pool. Their stream
starts with a claim (KVChunk.claim: the token, the reservation's block ids, the pool): decode checks it
against what it issued, marks the reservation as being written, and only then acknowledges (the
writer writes nothing before). While a claimed stream is open the reservation's blocks are never
freed: if the reservation ends meanwhile (lease, deadline, Abort), decode drops the stream's further
chunks and frees the blocks only when the writer's stream ends (the writer stops as soon as it sees
its stream fail, or at its last chunk).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from services.decode.reservations import Reservation
from services.engine.kv_layout import FP8_CODEC, HeadSplitSpec, PageLayout
from services.engine.kv_pages import KVPages
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.mooncake_staged import HostLanding
from services.engine.shared_kv import SharedKVAttachError, pool_id
from services.engine.spec.pools import offer_mooncake

IN_PLACE_TRANSPORTS = frozenset({"shm", "cuda-ipc", "mooncake"})
"""Transports that write pages into this decode's pool themselves; their chunks carry descriptors only."""
CODEC_OF = {common_pb2.KV_CODEC_FP8_E4M3: FP8_CODEC}
"""KVCodec -> the layout codec it names (KV_CODEC_NATIVE: the cache's own)."""

Reject = Callable[..., Exception]
"""Builds the rejection to raise: (code, message, metric reason, ErrorDetail reason, **fields)."""

log = logging.getLogger(__name__)


def offered_pool(pages: KVPages, mooncake_host: str, mooncake_engines: int = 1) -> decode_pb2.KVDestination | None:
    """The pool this decode offers side transports: registered with Mooncake when ``mooncake_host`` is
    set (any host may write; a device pool through a pinned host landing area, kv_transport/mooncake_staged;
    with ``mooncake_engines`` transfer engines, all offered), else the engine's same-host shm / CUDA IPC pool,
    else None."""
    if pages.has_draft and not mooncake_host:  # a second pool, offered with the target pool (KVDestination.draft)
        dest = pages.destination
        return dest if dest is not None and dest.HasField("draft") else None
    if pages.sharded:  # TP>1: every rank's own pool, written rank to rank (parallel/rank_pages.py)
        if mooncake_host:  # each rank's shard through its own transfer engines (parallel/mooncake_ranks.py)
            return pages.shard_writes().offer(mooncake_host, mooncake_engines)
        return pages.destination
    if mooncake_host:
        why = mooncake.available()
        try:
            if why is not None:
                raise SharedKVAttachError("unavailable", why)
            engine = mooncake.MooncakeEngine(mooncake_host, count=mooncake_engines)
            pages.exporters.append(engine)  # the engine serves the registered pool as long as it lives
            if pages.has_draft:  # both pools on the same engines (spec/pools.py); a device pool: none offered
                spec = pages._runner.spec  # the SpecDecoder whose draft pool KVPages.has_draft reports
                return offer_mooncake(engine, mooncake.export_pool(engine, pages.pool), spec.kv_cache, spec.region())
            if pages.pool.is_cuda:  # this Mooncake build moves host memory only
                landing = HostLanding(engine, pages.pool, pages.import_pages)
                pages.exporters.append(landing)
                return landing.destination
            return mooncake.export_pool(engine, pages.pool)
        except SharedKVAttachError as e:
            log.warning("KV pool not offered over Mooncake (prefills send page bytes instead): %s", e)
            if pages.has_draft:
                return None
    return pages.destination


def landing_for(pages: KVPages, pool: str) -> HostLanding | None:
    """The host landing area behind offered pool ``pool`` (a Mooncake-registered host copy of a device pool),
    where a writer puts pages that are imported as each chunk's descriptor lands; None without one."""
    return next((e for e in pages.exporters if isinstance(e, HostLanding) and pool_id(e.destination) == pool), None)


def check_claim(claim: common_pb2.KVClaim, r: Reservation, reject: Reject, *, pool: str, layout: PageLayout,
                layouts: Iterable[PageLayout], landing: HostLanding | None, split: HeadSplitSpec | None = None
                ) -> PageLayout:
    """A side-transport writer's claim must name this decode's pool (``pool``: the id Reserve offers, empty: none),
    exactly the reservation's blocks and a codec this pool takes (a descriptor for another reservation or another
    pool, or a codec not offered, is refused through ``reject``; nothing is freed). Returns the layout the
    stream's pages must be in: ``layout`` (the cache's own) or one of ``layouts`` a host ``landing`` accepts; for
    tensor-parallel head shards (``split``: this pool's head split) ``layout`` naming both splits."""
    if claim.transport not in IN_PLACE_TRANSPORTS:
        raise reject(grpc.StatusCode.INVALID_ARGUMENT, f"claim.transport: {claim.transport!r} does not "
                     f"write pages in place (known: {sorted(IN_PLACE_TRANSPORTS)})", "claim",
                     frees=False, field="claim.transport")
    if not pool or claim.pool_id != pool:
        raise reject(grpc.StatusCode.FAILED_PRECONDITION,
                     f"claim.pool_id: {claim.pool_id!r} is not this decode's pool "
                     f"({pool or 'none offered'})", "claim", Reason.ERROR_REASON_PERMISSION,
                     frees=False, field="claim.pool_id")
    if list(claim.dest_block_ids) != r.block_ids:
        raise reject(grpc.StatusCode.PERMISSION_DENIED,
                     f"claim.dest_block_ids: the writer names {len(claim.dest_block_ids)} blocks that are "
                     f"not reservation {r.reservation_id}'s", "claim", Reason.ERROR_REASON_PERMISSION,
                     frees=False, field="claim.dest_block_ids")
    if claim.codec in (common_pb2.KV_CODEC_UNSPECIFIED, common_pb2.KV_CODEC_NATIVE):
        return _with_splits(claim, reject, layout, split)
    lay = next((lay for lay in layouts if lay.target_codec == CODEC_OF.get(claim.codec)), None)
    if lay is None or landing is None or not landing.accepts(lay):
        raise reject(grpc.StatusCode.FAILED_PRECONDITION,
                     f"claim.codec: {common_pb2.KVCodec.Name(claim.codec)} is not offered for in-place "
                     f"writes by this decode (only a host landing area takes a wire codec; this pool "
                     f"takes {layout.target_codec})", "claim", Reason.ERROR_REASON_LAYOUT_MISMATCH,
                     frees=False, field="claim.codec")
    return lay


def _spec(m: common_pb2.KVHeadSplit) -> HeadSplitSpec:
    return HeadSplitSpec(m.tp_size, m.kv_heads_per_rank, m.replicas)


def _with_splits(claim: common_pb2.KVClaim, reject: Reject, layout: PageLayout, split: HeadSplitSpec | None
                 ) -> PageLayout:
    """The layout of a native-codec claim: ``layout`` itself (all heads into one pool), or, when either side is
    tensor-parallel, ``layout`` naming the writer's and this pool's head splits (a pool split that is not this
    decode's is refused naming both layouts; a writer split that does not cover the KV heads is invalid)."""
    named = claim.HasField("writer_split") and claim.HasField("pool_split")
    if not named and (split is None or split.tp_size == 1):
        return layout
    own = split or HeadSplitSpec(1, layout.num_kv_heads, 1)
    if not named:
        raise reject(grpc.StatusCode.FAILED_PRECONDITION,
                     f"claim.pool_split: this decode's pool is split over ranks ({layout.describe()} as "
                     f"{own.describe()}); the writer names no head split", "claim",
                     Reason.ERROR_REASON_LAYOUT_MISMATCH, frees=False, field="claim.pool_split")
    writer, pool = _spec(claim.writer_split), _spec(claim.pool_split)
    if pool != own:
        raise reject(grpc.StatusCode.FAILED_PRECONDITION,
                     f"claim.pool_split: the writer writes {layout.with_splits(writer, pool).describe()}; this "
                     f"decode's pool is {layout.with_splits(writer, own).describe()}", "claim",
                     Reason.ERROR_REASON_LAYOUT_MISMATCH, frees=False, field="claim.pool_split")
    if not 1 <= writer.tp_size <= 64 or writer.replicas < 1 or \
            writer.tp_size * writer.kv_heads_per_rank != layout.num_kv_heads * writer.replicas:
        raise reject(grpc.StatusCode.INVALID_ARGUMENT,
                     f"claim.writer_split: {writer.describe()} does not split {layout.num_kv_heads} KV heads",
                     "claim", frees=False, field="claim.writer_split")
    return layout.with_splits(writer, pool)
