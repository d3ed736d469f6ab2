"""The claim every in-place connector's stream opens with, and its check on decode: one part for all of them.

A writer may touch decode's pool only while decode knows it does: its stream's first message is a
``KVClaim`` (transport, the reservation's block ids, the pool id decode issued, the codec, the head splits of
tensor-parallel writes) with the reservation token; decode checks all of it before any byte is written,
marks the reservation as being written and acknowledges (``CLAIM_ACK``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import grpc

from services.common.grpc_util import Reason
from services.common.pb import common_pb2
from services.engine.kv_layout import FP8_CODEC, HeadSplitSpec, PageLayout
from services.engine.kv_transport.base import PageWriter
from services.engine.kv_transport.mooncake_staged import HostLanding
from services.kv import registry

CODEC_OF = {common_pb2.KV_CODEC_FP8_E4M3: FP8_CODEC}
"""KVCodec -> the layout codec it names (KV_CODEC_NATIVE: the cache's own)."""

Reject = Callable[..., Exception]
"""Builds the rejection to raise: (code, message, metric reason, ErrorDetail reason, **fields)."""


class Reserved(Protocol):
    """What the check reads of decode's reservation (services/decode/reservations.py)."""

    reservation_id: str
    block_ids: list[int]


def codec_pb(codec: str) -> int:
    """common_pb2.KVCodec of a layout codec name (the cache's own dtype: KV_CODEC_NATIVE)."""
    return common_pb2.KV_CODEC_FP8_E4M3 if codec == FP8_CODEC else common_pb2.KV_CODEC_NATIVE


def claim_message(request_id: str, reservation_id: str, reservation_token: bytes, writer: PageWriter,
                  dest_block_ids: list[int]) -> common_pb2.KVChunk:
    """The first message of a side transport's stream: it claims the reservation before any write."""
    msg = common_pb2.KVChunk(
        request_id=request_id, reservation_id=reservation_id, reservation_token=reservation_token,
        transport=writer.transport,
        claim=common_pb2.KVClaim(transport=writer.transport, dest_block_ids=dest_block_ids, pool_id=writer.pool_id,
                                 codec=codec_pb(writer.wire_codec)))
    if writer.splits is not None:  # tensor-parallel ranks write head shards: both splits are named
        for field, spec in zip(("writer_split", "pool_split"), writer.splits, strict=True):
            getattr(msg.claim, field).CopyFrom(common_pb2.KVHeadSplit(
                tp_size=spec.tp_size, kv_heads_per_rank=spec.kv_heads_per_rank, replicas=spec.replicas))
    return msg


def check_claim(claim: common_pb2.KVClaim, r: Reserved, reject: Reject, *, pool: str, layout: PageLayout,
                layouts: Iterable[PageLayout], landing: HostLanding | None, split: HeadSplitSpec | None = None
                ) -> PageLayout:
    """A side-transport writer's claim must name this decode's pool (``pool``: the id Reserve offers, empty: none),
    exactly the reservation's blocks and a codec this pool takes (a descriptor for another reservation or another
    pool, or a codec not offered, is refused through ``reject``; nothing is freed). Returns the layout the
    stream's pages must be in: ``layout`` (the cache's own) or one of ``layouts`` a host ``landing`` accepts; for
    tensor-parallel head shards (``split``: this pool's head split) ``layout`` naming both splits."""
    if not registry.writes_in_place(claim.transport):
        raise reject(grpc.StatusCode.INVALID_ARGUMENT, f"claim.transport: {claim.transport!r} does not "
                     f"write pages in place (known: {sorted(registry.IN_PLACE)})", "claim",
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
