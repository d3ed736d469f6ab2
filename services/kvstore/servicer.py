"""gRPC KVStore servicer: proto <-> backend calls, bad input refused with a status naming what and why.

Writes are guarded: with mTLS on, only a peer whose certificate says ``prefill`` may Put or Delete
(Lookup/Get answer any authenticated peer). A Put stream never allocates what a page announces: pieces
are kept as they arrive, and the quota is charged on the bytes that arrived, never on an announcement.
The bytes of unfinished pages of all open Put streams fit in ``max_inflight_put_bytes`` together, and
one peer identity (its certificate's CN under mTLS, else its IP address) holds at most its share of it
(:class:`PutQuota`); past either RESOURCE_EXHAUSTED, retryable.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.grpc_util import Reason, abort, abort_if_draining, abort_invalid, error_detail
from services.common.kvstore_pages import DEFAULT_PIECE_BYTES, PageAssembler, PageStreamError, split_page
from services.common.pb import kvstore_pb2 as pb
from services.common.pb import kvstore_pb2_grpc as pb_grpc
from services.common.tls import peer_identity, peer_may_write_kv, peer_role
from services.kvstore.backend import (
    ChecksumMismatchError,
    InvalidKeyError,
    KVStoreBackend,
    PageTooLargeError,
    fingerprint_problem,
    hash_problem,
    key_str,
)

SERVICE = "kvstore"
QUOTA_RETRY_AFTER_MS = 1000
# With mTLS on: who may read pages (Get) and which pages exist (Lookup). Prefills read prefixes; the
# router may ask what is cached for prefix-aware routing.
_GET_ROLES = frozenset({"prefill"})
_LOOKUP_ROLES = frozenset({"prefill", "router"})
"""Suggested wait before retrying a Put refused for the in-flight quota (milliseconds)."""


class PutQuota:
    """Bytes of unfinished pages that open Put streams received, per peer identity (one event loop: no lock).

    A peer may hold at most ``limit // max(2, holders)`` bytes, where holders counts the peers holding
    bytes (itself included): one caller never holds more than half, so another always finds room, and
    with more callers each is bounded by an equal share. A peer over its share (others arrived after it
    took it) takes nothing more until its pages land or its streams end."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.held: dict[str, int] = {}
        """peer identity -> bytes it holds (> 0 only)."""

    def share(self, peer: str) -> int:
        holders = len(self.held) + (peer not in self.held)
        return self.limit // max(2, holders)

    def take(self, peer: str, n: int) -> bool:
        if self.used + n > self.limit or self.held.get(peer, 0) + n > self.share(peer):
            return False
        self.used += n
        self.held[peer] = self.held.get(peer, 0) + n
        return True

    def release(self, peer: str, n: int) -> None:
        if n == 0:
            return
        self.used -= n
        left = self.held[peer] - n
        assert self.used >= 0 and left >= 0, "PutQuota released more than it took"
        if left:
            self.held[peer] = left
        else:
            del self.held[peer]


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """``backend`` may be set after registration (it opens during warmup); until then UNAVAILABLE."""

    def __init__(self, backend: KVStoreBackend | None, *, max_page_bytes: int,
                 piece_bytes: int = DEFAULT_PIECE_BYTES, draining: asyncio.Event | None = None,
                 max_inflight_put_bytes: int = 256 << 20, put_idle_timeout_s: float = 30.0,
                 tls_on: bool = False) -> None:
        self.backend = backend
        self.max_page_bytes = max_page_bytes
        self.piece_bytes = piece_bytes
        self.draining = draining if draining is not None else asyncio.Event()
        self.quota = PutQuota(max_inflight_put_bytes)
        self.put_idle_timeout_s = put_idle_timeout_s
        self.tls_on = tls_on
        """With mTLS on, Put and Delete need a peer certificate with role prefill."""
        self.get_bytes = 0
        """Page bytes returned by Get since start."""
        self.put_bytes = 0
        """Page bytes accepted by Put since start."""
        self.put_refused: Counter[str] = Counter()
        """Put streams refused since start, by reason (the metric's label)."""

    async def _backend(self, context: grpc.aio.ServicerContext) -> KVStoreBackend:
        if self.backend is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "kvstore is starting: its backend is not open yet",
                        error_detail(Reason.ERROR_REASON_LOADING, retryable=True, side=SERVICE))
        return self.backend

    async def _require_writer(self, context: grpc.aio.ServicerContext, rpc: str) -> None:
        if not peer_may_write_kv(context, self.tls_on):
            self.put_refused["permission"] += rpc == "Put"
            await abort(context, grpc.StatusCode.PERMISSION_DENIED,
                        f"{rpc}: only a prefill (client certificate role 'prefill') may write KV pages",
                        error_detail(Reason.ERROR_REASON_PERMISSION, side=SERVICE))

    async def _require_reader(self, context: grpc.aio.ServicerContext, rpc: str, roles: frozenset[str]) -> None:
        """With mTLS on, reading pages (or which pages exist) takes a service role: a certificate without
        one (e.g. the `client` certificate for router callers) learns nothing of other users' prompts."""
        if self.tls_on and peer_role(context) not in roles:
            await abort(context, grpc.StatusCode.PERMISSION_DENIED,
                        f"{rpc}: only a {' or '.join(sorted(roles))} (client certificate role) may read the "
                        f"kvstore; this certificate's role is {peer_role(context) or 'none'}",
                        error_detail(Reason.ERROR_REASON_PERMISSION, side=SERVICE))

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        await self._require_reader(context, "Lookup", _LOOKUP_ROLES)
        backend = await self._backend(context)
        await _check_keys(context, request.layout_fingerprint, request.block_hashes)
        tiers = await backend.locate(request.layout_fingerprint, list(request.block_hashes))
        return pb.LookupResponse(num_present=len(tiers), tiers=tiers)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Page]:
        """Streams the leading present pages. The first page missing: NOT_FOUND; a later one: the stream
        ends early (pages can be evicted between Lookup and Get; the caller sees a shorter prefix)."""
        await abort_if_draining(context, self.draining, SERVICE)
        await self._require_reader(context, "Get", _GET_ROLES)
        backend = await self._backend(context)
        fp = request.layout_fingerprint
        await _check_keys(context, fp, request.block_hashes)
        for i, h in enumerate(request.block_hashes):
            page = await backend.get_page(fp, h)
            if page is None:
                if i == 0:
                    await abort(context, grpc.StatusCode.NOT_FOUND, f"page {key_str(fp, h)} not found")
                return
            self.get_bytes += len(page[0])
            for piece in split_page(fp, h, page[0], page[1], self.piece_bytes):
                yield piece

    async def Put(self, request_iterator: AsyncIterator[pb.Page], context: grpc.aio.ServicerContext
                  ) -> pb.PutResponse:
        await abort_if_draining(context, self.draining, SERVICE)
        await self._require_writer(context, "Put")
        backend = await self._backend(context)
        assembler = PageAssembler(self.max_page_bytes)
        peer = peer_identity(context)
        stored = skipped = 0
        held = 0  # quota this stream holds for the page it is assembling: the bytes that arrived
        reason, code, message = "", grpc.StatusCode.OK, ""
        detail = None
        pieces = aiter(request_iterator)
        try:
            while True:
                try:
                    piece = await asyncio.wait_for(anext(pieces), self.put_idle_timeout_s)
                except StopAsyncIteration:
                    break
                if assembler.in_progress is None:
                    bad = _key_problem(piece.layout_fingerprint, [piece.block_hash])
                    if bad is not None:
                        reason, code, message = "invalid", grpc.StatusCode.INVALID_ARGUMENT, f"{bad[0]}: {bad[1]}"
                        break
                if piece.total_size <= self.max_page_bytes:  # larger: the assembler refuses it below
                    n = len(piece.payload)
                    if not self.quota.take(peer, n):
                        reason, code = "quota", grpc.StatusCode.RESOURCE_EXHAUSTED
                        message = (f"page {key_str(piece.layout_fingerprint, piece.block_hash)}: open Put "
                                   f"streams hold {self.quota.used} of {self.quota.limit} bytes "
                                   f"(--max-inflight-put-bytes), this peer {self.quota.held.get(peer, 0)} of its "
                                   f"share {self.quota.share(peer)}; {n} more do not fit")
                        detail = error_detail(Reason.ERROR_REASON_OVERLOADED, retryable=True, side=SERVICE,
                                              retry_after_ms=QUOTA_RETRY_AFTER_MS)
                        break
                    held += n
                page = assembler.add(piece)
                if page is None:
                    continue
                if await backend.put(page.fp, page.h, page.data, page.crc):
                    stored += 1
                    self.put_bytes += len(page.data)
                else:
                    skipped += 1
                self.quota.release(peer, held)
                held = 0
            if not reason:
                assembler.finish()
        except TimeoutError:
            reason, code = "idle", grpc.StatusCode.DEADLINE_EXCEEDED
            message = f"no piece for {self.put_idle_timeout_s} s (--put-idle-timeout-s)"
        except PageStreamError as e:
            too_large = e.kind == "too_large"
            reason = "too_large" if too_large else "invalid"
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if too_large else grpc.StatusCode.INVALID_ARGUMENT
            message = str(e)
            detail = error_detail(Reason.ERROR_REASON_INVALID_INPUT, side=SERVICE, field="total_size" if too_large
                                  else "")
        except ChecksumMismatchError as e:
            reason, code, message = "checksum", grpc.StatusCode.DATA_LOSS, str(e)
        except PageTooLargeError as e:
            reason, code, message = "too_large", grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
            detail = error_detail(Reason.ERROR_REASON_INVALID_INPUT, side=SERVICE, field="total_size")
        except InvalidKeyError as e:
            reason, code, message = "invalid", grpc.StatusCode.INVALID_ARGUMENT, f"page key: {e}"
        finally:
            self.quota.release(peer, held)
        if reason:
            self.put_refused[reason] += 1
            await abort(context, code, f"{message} ({stored} earlier pages stored, {skipped} skipped)", detail)
        return pb.PutResponse(stored=stored, skipped_existing=skipped)

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
        await self._require_writer(context, "Delete")
        backend = await self._backend(context)
        fp = request.layout_fingerprint
        await _check_keys(context, fp, request.block_hashes)
        if request.all_for_layout:
            if request.block_hashes:
                await abort_invalid(context, "DeleteRequest", "all_for_layout is set, so block_hashes must be "
                                    f"empty (got {len(request.block_hashes)})")
            return pb.DeleteResponse(deleted=await backend.delete_layout(fp))
        return pb.DeleteResponse(deleted=await backend.delete(fp, list(request.block_hashes)))

    async def Stats(self, request: pb.StatsRequest, context: grpc.aio.ServicerContext) -> pb.StatsResponse:
        stats = (await self._backend(context)).stats()
        return pb.StatsResponse(tiers=[
            pb.TierStats(name=t.name, bytes=t.bytes, capacity_bytes=t.capacity_bytes, entries=t.entries,
                         hits=t.hits, misses=t.misses, evictions=t.evictions, corrupt=t.corrupt)
            for t in stats.tiers
        ])


def _key_problem(fp: str, hashes: Sequence[bytes]) -> tuple[str, str] | None:
    """(field, why) of the first malformed key part, or None."""
    problem = fingerprint_problem(fp)
    if problem is not None:
        return "layout_fingerprint", problem
    for i, h in enumerate(hashes):
        problem = hash_problem(h)
        if problem is not None:
            return (f"block_hashes[{i}]" if len(hashes) > 1 else "block_hash"), problem
    return None


async def _check_keys(context: grpc.aio.ServicerContext, fp: str, hashes: Sequence[bytes]) -> None:
    bad = _key_problem(fp, hashes)
    if bad is not None:
        await abort_invalid(context, *bad)
