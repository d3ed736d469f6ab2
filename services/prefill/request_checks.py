"""Range checks of a PrefillRequest at the boundary: every field that indexes anything, before any
work starts. Each check returns ``(field, why)`` for INVALID_ARGUMENT, or None."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from services.common.pb import prefill_pb2
from services.prefill.attach import early_problem

if TYPE_CHECKING:
    from services.engine.kv_layout import PageLayout

MAX_ID_CHARS = 256
"""Longest request_id / attach_id / reservation_id / decode_address accepted (characters)."""
MAX_TOKEN_BYTES = 64
"""Longest reservation_token accepted (bytes; decode issues 16)."""


def problem(request: prefill_pb2.PrefillRequest, *, vocab_size: int, max_model_len: int, block_size: int
            ) -> tuple[str, str] | None:
    """Every field of a Prefill call; an early one (attach_id set) carries no reservation field."""
    early = bool(request.attach_id)
    bad = ids_problem(request, ("request_id", "attach_id") if early else ("request_id",))
    if bad is not None:
        return bad
    if early:
        bad = early_problem(request)
        if bad is not None:
            return bad
    ids = request.token_ids[:]  # a list in one C copy: min/max over it beat min/max over the upb container
    if not ids:
        return "token_ids", "must not be empty"
    if len(ids) >= max_model_len:
        return "token_ids", (f"{len(ids)} tokens do not fit the context of {max_model_len} tokens (one position "
                             "must remain for the output)")
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        return "token_ids", f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})"
    if not early:
        bad = reservation_problem(request, block_size)
        if bad is not None:
            return bad
    if not math.isfinite(request.deadline_unix) or request.deadline_unix < 0:
        return "deadline_unix", f"must be a finite time >= 0, got {request.deadline_unix}"
    return None


def reservation_problem(request: prefill_pb2.PrefillRequest, block_size: int) -> tuple[str, str] | None:
    """The reservation fields of a full PrefillRequest (an early one's once its attach is merged in)."""
    bad = ids_problem(request, ("decode_address", "reservation_id"))
    if bad is not None:
        return bad
    if not request.reservation_token:
        return "reservation_token", "must not be empty (ReserveResponse.reservation_token)"
    if len(request.reservation_token) > MAX_TOKEN_BYTES:
        return "reservation_token", f"{len(request.reservation_token)} bytes; at most {MAX_TOKEN_BYTES}"
    blocks = -(-len(request.token_ids) // block_size)
    if request.num_skip_blocks > blocks:
        return "num_skip_blocks", f"{request.num_skip_blocks} exceeds the prompt's {blocks} blocks"
    if request.dest_block_ids and len(request.dest_block_ids) != blocks:
        return "dest_block_ids", (f"{len(request.dest_block_ids)} block ids for a prompt of "
                                  f"{len(request.token_ids)} tokens ({blocks} blocks of {block_size})")
    return None


def ids_problem(request: prefill_pb2.PrefillRequest | prefill_pb2.AttachReservationRequest, names: tuple[str, ...]
                ) -> tuple[str, str] | None:
    """Each of ``names`` holds 1 to MAX_ID_CHARS characters."""
    for name in names:
        value = getattr(request, name)
        if not value:
            return name, "must not be empty"
        if len(value) > MAX_ID_CHARS:
            return name, f"{len(value)} characters; at most {MAX_ID_CHARS}"
    return None


def layout_mismatch(request: prefill_pb2.PrefillRequest, layout: PageLayout) -> str | None:
    """Why decode's expected KV layout (``expected_layout_fingerprint``, empty: any) is not ``layout``'s, for
    FAILED_PRECONDITION with reason LAYOUT_MISMATCH; None when it matches."""
    want = request.expected_layout_fingerprint
    if not want or want == layout.fingerprint:
        return None
    return (f"KV layout fingerprint mismatch: decode expects {want}, this prefill produces {layout.fingerprint} "
            f"({layout.describe()})")


def deadline_monotonic(deadline_unix: float, grpc_remaining_s: float | None) -> float | None:
    """The request's deadline on the monotonic clock: the earlier of ``deadline_unix`` (0: none) and the
    gRPC deadline (``context.time_remaining()``, None: none); None when there is neither."""
    now_mono = time.monotonic()
    candidates = []
    if deadline_unix > 0:
        candidates.append(now_mono + (deadline_unix - time.time()))
    if grpc_remaining_s is not None:
        candidates.append(now_mono + grpc_remaining_s)
    return min(candidates) if candidates else None
