"""A thin async client for the KVStore service (page splitting and reassembly included)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence

import grpc

from services.common.kvstore_pages import DEFAULT_PIECE_BYTES, AssembledPage, PageAssembler, split_page
from services.common.pb import kvstore_pb2 as pb
from services.common.pb import kvstore_pb2_grpc as pb_grpc

PageIn = tuple[bytes, bytes, int]
"""(block hash, payload, crc32)."""


class KVStoreClient:
    def __init__(self, channel: grpc.aio.Channel, *, piece_bytes: int = DEFAULT_PIECE_BYTES,
                 max_page_bytes: int = 1 << 40) -> None:
        self.stub = pb_grpc.KVStoreStub(channel)
        self._put_serialized = channel.stream_unary("/pdserve.v1.KVStore/Put", request_serializer=None,
                                                    response_deserializer=pb.PutResponse.FromString)
        """Put with messages the caller serialized (``kvstore_pages.serialized_pieces``): sent as they are."""
        self.piece_bytes = piece_bytes
        self.max_page_bytes = max_page_bytes

    async def lookup(self, fp: str, hashes: Sequence[bytes]) -> pb.LookupResponse:
        return await self.stub.Lookup(pb.LookupRequest(layout_fingerprint=fp, block_hashes=list(hashes)))

    async def get(self, fp: str, hashes: Sequence[bytes]) -> list[AssembledPage]:
        """The leading present pages (raises AioRpcError NOT_FOUND when the first is absent)."""
        assembler = PageAssembler(self.max_page_bytes)
        pages: list[AssembledPage] = []
        async for piece in self.stub.Get(pb.GetRequest(layout_fingerprint=fp, block_hashes=list(hashes))):
            page = assembler.add(piece)
            if page is not None:
                pages.append(page)
        assembler.finish()
        return pages

    async def put(self, fp: str, pages: Iterable[PageIn]) -> pb.PutResponse:
        async def pieces() -> AsyncIterator[pb.Page]:
            for h, data, crc in pages:
                for piece in split_page(fp, h, data, crc, self.piece_bytes):
                    yield piece
        return await self.stub.Put(pieces())

    async def put_serialized(self, messages: Iterable[bytes]) -> pb.PutResponse:
        """Put of Page messages already serialized (``kvstore_pages.serialized_pieces``), in order."""
        async def pieces() -> AsyncIterator[bytes]:
            for m in messages:
                yield m
        return await self._put_serialized(pieces())

    async def delete(self, fp: str, hashes: Sequence[bytes] = (), *, all_for_layout: bool = False) -> int:
        resp = await self.stub.Delete(pb.DeleteRequest(layout_fingerprint=fp, block_hashes=list(hashes),
                                                       all_for_layout=all_for_layout))
        return int(resp.deleted)

    async def stats(self) -> pb.StatsResponse:
        return await self.stub.Stats(pb.StatsRequest())
