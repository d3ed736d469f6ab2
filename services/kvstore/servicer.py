"""gRPC KVStore servicer: proto <-> backend calls, bad input refused with a status naming what and why."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from services.common.grpc_util import abort, abort_if_draining, abort_invalid
from services.common.kvstore_pages import DEFAULT_PIECE_BYTES, PageAssembler, PageStreamError, split_page
from services.common.pb import kvstore_pb2 as pb
from services.common.pb import kvstore_pb2_grpc as pb_grpc
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


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """``backend`` may be set after registration (it opens during warmup); until then UNAVAILABLE."""

    def __init__(self, backend: KVStoreBackend | None, *, max_page_bytes: int,
                 piece_bytes: int = DEFAULT_PIECE_BYTES, draining: asyncio.Event | None = None) -> None:
        self.backend = backend
        self.max_page_bytes = max_page_bytes
        self.piece_bytes = piece_bytes
        self.draining = draining if draining is not None else asyncio.Event()
        self.get_bytes = 0
        """Page bytes returned by Get since start."""
        self.put_bytes = 0
        """Page bytes accepted by Put since start."""

    async def _backend(self, context: grpc.aio.ServicerContext) -> KVStoreBackend:
        if self.backend is None:
            await abort(context, grpc.StatusCode.UNAVAILABLE, "kvstore is starting: its backend is not open yet")
        return self.backend

    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext) -> pb.LookupResponse:
        backend = await self._backend(context)
        await _check_keys(context, request.layout_fingerprint, request.block_hashes)
        tiers = await backend.locate(request.layout_fingerprint, list(request.block_hashes))
        return pb.LookupResponse(num_present=len(tiers), tiers=tiers)

    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.Page]:
        """Streams the leading present pages. The first page missing: NOT_FOUND; a later one: the stream
        ends early (pages can be evicted between Lookup and Get; the caller sees a shorter prefix)."""
        await abort_if_draining(context, self.draining, SERVICE)
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
        backend = await self._backend(context)
        assembler = PageAssembler(self.max_page_bytes)
        stored = skipped = 0
        try:
            async for piece in request_iterator:
                if assembler.in_progress is None:
                    await _check_keys(context, piece.layout_fingerprint, [piece.block_hash])
                page = assembler.add(piece)
                if page is None:
                    continue
                if await backend.put(page.fp, page.h, page.data, page.crc):
                    stored += 1
                    self.put_bytes += len(page.data)
                else:
                    skipped += 1
            assembler.finish()
        except PageStreamError as e:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if e.kind == "too_large" else grpc.StatusCode.INVALID_ARGUMENT
            await abort(context, code, f"{e} ({stored} earlier pages stored, {skipped} skipped)")
        except ChecksumMismatchError as e:
            await abort(context, grpc.StatusCode.DATA_LOSS, f"{e} ({stored} earlier pages stored)")
        except PageTooLargeError as e:
            await abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except InvalidKeyError as e:
            await abort_invalid(context, "page key", str(e))
        return pb.PutResponse(stored=stored, skipped_existing=skipped)

    async def Delete(self, request: pb.DeleteRequest, context: grpc.aio.ServicerContext) -> pb.DeleteResponse:
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


async def _check_keys(context: grpc.aio.ServicerContext, fp: str, hashes: Sequence[bytes]) -> None:
    problem = fingerprint_problem(fp)
    if problem is not None:
        await abort_invalid(context, "layout_fingerprint", problem)
    for i, h in enumerate(hashes):
        problem = hash_problem(h)
        if problem is not None:
            await abort_invalid(context, f"block_hashes[{i}]" if len(hashes) > 1 else "block_hash", problem)
