"""KVStore gRPC service on a real grpc.aio server (ephemeral loopback port), every backend."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from services.common.checksum import checksum
from services.common.grpc_util import create_channel, server_options
from services.common.kvstore_client import KVStoreClient
from services.common.kvstore_pages import serialized_pieces, split_page
from services.common.pb import kvstore_pb2 as pb
from services.common.pb import kvstore_pb2_grpc as pb_grpc
from services.kvstore.backend import KVStoreBackend
from services.kvstore.config import KVStoreConfig
from services.kvstore.servicer import KVStoreServicer
from tests.kvstore.conftest import KiB, MiB, PageFactory, new_fp, new_hash

MAX_PAGE = 2 * MiB
PIECE = 256 * KiB


@dataclass
class Served:
    client: KVStoreClient
    stub: pb_grpc.KVStoreStub
    servicer: KVStoreServicer


@pytest.fixture
async def served(backend: KVStoreBackend) -> AsyncIterator[Served]:
    server = grpc.aio.server(options=server_options())
    servicer = KVStoreServicer(backend, max_page_bytes=MAX_PAGE, piece_bytes=PIECE)
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with create_channel(f"127.0.0.1:{port}") as channel:
            yield Served(KVStoreClient(channel, piece_bytes=PIECE), pb_grpc.KVStoreStub(channel), servicer)
    finally:
        await server.stop(0)


async def test_put_lookup_get_multi_piece_pages(served: Served, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(size) for size in (0, 1 * KiB, PIECE, PIECE + 1, 1 * MiB + 3)]
    resp = await served.client.put(fp, pages)
    assert (resp.stored, resp.skipped_existing) == (len(pages), 0)
    resp = await served.client.put(fp, pages[:2])
    assert (resp.stored, resp.skipped_existing) == (0, 2)
    hashes = [h for h, _, _ in pages]
    lk = await served.client.lookup(fp, [*hashes, new_hash()])
    assert lk.num_present == len(pages) and len(lk.tiers) == len(pages)
    got = await served.client.get(fp, hashes)
    assert [(g.h, g.data, g.crc) for g in got] == pages
    stats = await served.client.stats()
    assert sum(t.hits for t in stats.tiers) >= len(pages)


async def test_put_of_pre_serialized_pieces(served: Served, page: PageFactory) -> None:
    """serialized_pieces gives split_page's messages byte for byte in meaning (parsed equal), built from any
    buffer; Put of them stores pages that Get returns unchanged."""
    fp = new_fp()
    pages = [page(size) for size in (0, 1 * KiB, PIECE, PIECE + 1, 1 * MiB + 3)]
    for h, data, crc in pages:
        made = list(serialized_pieces(fp, h, memoryview(bytearray(data)), crc, PIECE))
        assert [pb.Page.FromString(m) for m in made] == list(split_page(fp, h, data, crc, PIECE))
    resp = await served.client.put_serialized(m for h, data, crc in pages
                                              for m in serialized_pieces(fp, h, data, crc, PIECE))
    assert (resp.stored, resp.skipped_existing) == (len(pages), 0)
    got = await served.client.get(fp, [h for h, _, _ in pages])
    assert [(g.h, g.data, g.crc) for g in got] == pages
    with pytest.raises(ValueError, match="piece_bytes"):
        next(serialized_pieces(fp, pages[1][0], pages[1][1], pages[1][2], 0))


async def test_get_unknown_first_page_not_found_later_page_ends_stream(served: Served, page: PageFactory) -> None:
    fp = new_fp()
    p = page(1 * KiB)
    await served.client.put(fp, [p])
    missing = new_hash()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.client.get(fp, [missing])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and f"{fp}/{missing.hex()}" in (e.value.details() or "")
    got = await served.client.get(fp, [p[0], missing, p[0]])
    assert len(got) == 1


async def test_delete_rpc(served: Served, page: PageFactory) -> None:
    fp = new_fp()
    pages = [page(1 * KiB) for _ in range(3)]
    await served.client.put(fp, pages)
    assert await served.client.delete(fp, [pages[0][0]]) == 1
    assert await served.client.delete(fp, all_for_layout=True) == 2
    assert (await served.client.lookup(fp, [p[0] for p in pages])).num_present == 0
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.client.delete(fp, [pages[0][0]], all_for_layout=True)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def _put_raw(stub: pb_grpc.KVStoreStub, pieces: list[pb.Page]) -> grpc.aio.AioRpcError:
    async def gen() -> AsyncIterator[pb.Page]:
        for p in pieces:
            yield p
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Put(gen())
    return e.value


def _pieces(fp: str, size: int = 3 * PIECE) -> tuple[bytes, bytes, list[pb.Page]]:
    h, data = new_hash(), os.urandom(size)
    return h, data, list(split_page(fp, h, data, checksum(data), PIECE))


async def test_bad_put_streams_rejected(served: Served) -> None:
    fp = new_fp()
    h, data, pieces = _pieces(fp)
    cases: list[tuple[list[pb.Page], grpc.StatusCode, str]] = [
        (pieces[:-1], grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        ([pieces[0], pieces[2]], grpc.StatusCode.INVALID_ARGUMENT, f"expected {PIECE}"),
        ([pb.Page(layout_fingerprint=fp, block_hash=h, payload=data[:10], checksum=checksum(data),
                  total_size=len(data), last_piece=True)], grpc.StatusCode.INVALID_ARGUMENT, "truncated"),
        ([pb.Page(layout_fingerprint="xyz", block_hash=h, payload=b"a", total_size=1, last_piece=True)],
         grpc.StatusCode.INVALID_ARGUMENT, "layout_fingerprint: must be 16"),
        ([pb.Page(layout_fingerprint=fp, block_hash=b"short", payload=b"a", total_size=1, last_piece=True)],
         grpc.StatusCode.INVALID_ARGUMENT, "block_hash: must be 16 bytes, got 5"),
        ([pb.Page(layout_fingerprint=fp, block_hash=h, payload=b"a", checksum=checksum(b"a") ^ 5, total_size=1,
                  last_piece=True)], grpc.StatusCode.DATA_LOSS, "checksum mismatch"),
        ([pb.Page(layout_fingerprint=fp, block_hash=h, payload=b"", total_size=MAX_PAGE + 1)],
         grpc.StatusCode.RESOURCE_EXHAUSTED, f"{MAX_PAGE + 1} bytes exceeds the {MAX_PAGE}-byte page limit"),
    ]
    for pieces_, code, text in cases:
        err = await _put_raw(served.stub, pieces_)
        assert err.code() == code, (text, err)
        assert text in (err.details() or ""), (text, err.details())
    assert (await served.client.lookup(fp, [h])).num_present == 0


async def test_bad_keys_on_lookup_and_get(served: Served) -> None:
    for call in (served.client.lookup, served.client.get):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call("0123", [new_hash()])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(new_fp(), [new_hash(), b"x" * 17])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block_hashes[1]: must be 16 bytes, got 17" in (e.value.details() or "")


async def test_unavailable_before_backend_and_while_draining(served: Served) -> None:
    backend = served.servicer.backend
    served.servicer.backend = None
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.client.stats()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    served.servicer.backend = backend
    served.servicer.draining.set()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await served.client.get(new_fp(), [new_hash()])
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_config_validation() -> None:
    from services.common.config import ConfigError, from_args

    cfg = from_args(KVStoreConfig, {}, environ={"PDSERVE_KVSTORE_MEMORY_BYTES": "1_000_000"})
    assert cfg.memory_bytes == 1_000_000 and cfg.backend == "embedded"
    with pytest.raises(ConfigError, match="PDSERVE_KVSTORE_PIECE_BYTES"):
        from_args(KVStoreConfig, {"piece_bytes": 128 * MiB})
    with pytest.raises(ConfigError, match="--memory-bytes / PDSERVE_KVSTORE_MEMORY_BYTES"):
        from_args(KVStoreConfig, {"memory_bytes": 0})
