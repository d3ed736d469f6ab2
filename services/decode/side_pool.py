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
from services.engine.kv_layout import FP8_CODEC, PageLayout
from services.engine.kv_pages import KVPages
from services.engine.kv_transport import mooncake
from services.engine.kv_transport.mooncake_staged import HostLanding
from services.engine.shared_kv import SharedKVAttachError, pool_id

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
    if pages.sharded or pages.has_draft:  # TP>1: the pool is split over ranks; a draft region is a second
        return None                          # pool: prefills send (full-head, both-region) page bytes instead
    if mooncake_host:
        why = mooncake.available()
        try:
            if why is not None:
                raise SharedKVAttachError("unavailable", why)
            engine = mooncake.MooncakeEngine(mooncake_host, count=mooncake_engines)
            pages.exporters.append(engine)  # the engine serves the registered pool as long as it lives
            if pages.pool.is_cuda:  # this Mooncake build moves host memory only
                landing = HostLanding(engine, pages.pool, pages.import_pages)
                pages.exporters.append(landing)
                return landing.destination
            return mooncake.export_pool(engine, pages.pool)
        except SharedKVAttachError as e:
            log.warning("KV pool not offered over Mooncake (prefills send page bytes instead): %s", e)
    return pages.destination


def landing_for(pages: KVPages, pool: str) -> HostLanding | None:
    """The host landing area behind offered pool ``pool`` (a Mooncake-registered host copy of a device pool),
    where a writer puts pages that are imported as each chunk's descriptor lands; None without one."""
    return next((e for e in pages.exporters if isinstance(e, HostLanding) and pool_id(e.destination) == pool), None)


def check_claim(claim: common_pb2.KVClaim, r: Reservation, reject: Reject, *, pool: str, layout: PageLayout,
                layouts: Iterable[PageLayout], landing: HostLanding | None) -> PageLayout:
    """A side-transport writer's claim must name this decode's pool (``pool``: the id Reserve offers, empty: none),
    exactly the reservation's blocks and a codec this pool takes (a descriptor for another reservation or another
    pool, or a codec not offered, is refused through ``reject``; nothing is freed). Returns the layout the
    stream's pages must be in: ``layout`` (the cache's own) or one of ``layouts`` a host ``landing`` accepts."""
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
        return layout
    lay = next((lay for lay in layouts if lay.target_codec == CODEC_OF.get(claim.codec)), None)
    if lay is None or landing is None or not landing.accepts(lay):
        raise reject(grpc.StatusCode.FAILED_PRECONDITION,
                     f"claim.codec: {common_pb2.KVCodec.Name(claim.codec)} is not offered for in-place "
                     f"writes by this decode (only a host landing area takes a wire codec; this pool "
                     f"takes {layout.target_codec})", "claim", Reason.ERROR_REASON_LAYOUT_MISMATCH,
                     frees=False, field="claim.codec")
    return lay
