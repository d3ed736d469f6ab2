"""kvstore Put under attack: announcements cost nothing (the quota is charged on bytes that arrived), a
quota bounds all open Put streams together and each peer identity to its share, idle streams end, and
with mTLS only a prefill may write."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.common.checksum import checksum
from services.common.grpc_util import Reason, create_channel, detail_of, server_options
from services.common.kvstore_client import KVStoreClient
from services.common.pb import kvstore_pb2 as pb
from services.common.pb import kvstore_pb2_grpc as pb_grpc
from services.common.tls import DEFAULT_SERVER_NAME, TLSConfig, make_certs
from services.kvstore.embedded import EmbeddedBackend
from services.kvstore.servicer import KVStoreServicer
from tests.grpc_server import loopback_server
from tests.kvstore.conftest import KiB, MiB, new_fp, new_hash


@dataclass
class Store:
    address: str
    servicer: KVStoreServicer


async def _serve(tls: TLSConfig | None = None, **kwargs) -> tuple[grpc.aio.Server, Store]:
    kwargs.setdefault("max_page_bytes", 64 * MiB)
    servicer = KVStoreServicer(EmbeddedBackend(memory_bytes=256 * MiB), tls_on=tls is not None, **kwargs)
    server, address = await loopback_server(lambda s: pb_grpc.add_KVStoreServicer_to_server(servicer, s), tls,
                                            options=server_options())
    return server, Store(address, servicer)


@pytest.fixture
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    server, s = await _serve(**getattr(request, "param", {}))
    try:
        yield s
    finally:
        await server.stop(0)
        await s.servicer.backend.close()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class OpenPut:
    """A Put stream that sends the first piece of a page announcing ``total`` bytes, then waits."""

    def __init__(self, stub: pb_grpc.KVStoreStub, total: int, first: int = 64 * KiB) -> None:
        self.fp, self.h = new_fp(), new_hash()
        self.data = os.urandom(first)
        self.total = total
        self.release = asyncio.Event()
        self.finish_page = False
        self.call = stub.Put(self._pieces())

    async def _pieces(self) -> AsyncIterator[pb.Page]:
        rest = os.urandom(self.total - len(self.data)) if self.total <= 8 * MiB else b""
        crc = checksum(self.data + rest)  # the same on every piece of a page
        yield pb.Page(layout_fingerprint=self.fp, block_hash=self.h, payload=self.data, checksum=crc, offset=0,
                      total_size=self.total)
        await self.release.wait()
        if self.finish_page:
            yield pb.Page(layout_fingerprint=self.fp, block_hash=self.h, payload=rest, checksum=crc,
                          offset=len(self.data), total_size=self.total, last_piece=True)

    async def outcome(self) -> grpc.StatusCode | pb.PutResponse:
        try:
            return await self.call
        except grpc.aio.AioRpcError as e:
            return e.code()


async def _wait_for(cond, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


async def test_huge_announcements_hold_only_the_bytes_that_arrived(store: Store) -> None:
    """10 streams announcing 60 MiB and sending 64 KiB each (the attack that once held 240 of the 256 MiB
    quota for the idle timeout): each holds the 64 KiB it sent, RSS grows by what arrived, and a real
    Put still lands while they are open."""
    announced, sent = 60 * MiB, 64 * KiB
    async with create_channel(store.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        await KVStoreClient(ch).stats()  # channel up before the RSS baseline
        rss0 = _rss_bytes()
        puts = [OpenPut(stub, announced, first=sent) for _ in range(10)]
        await _wait_for(lambda: store.servicer.quota.used == 10 * sent)
        assert store.servicer.put_refused["quota"] == 0
        grown = _rss_bytes() - rss0
        assert grown < 40 * MiB, f"RSS grew {grown / MiB:.1f} MiB for {10 * announced / MiB:.0f} MiB announced"
        data = os.urandom(8 * MiB)  # a real page, from the same peer, meanwhile
        resp = await KVStoreClient(ch).put(new_fp(), [(new_hash(), data, checksum(data))])
        assert resp.stored == 1 and store.servicer.quota.used == 10 * sent
        for p in puts:
            p.release.set()  # all ten end truncated
        outcomes = await asyncio.gather(*(p.outcome() for p in puts))
        assert outcomes.count(grpc.StatusCode.INVALID_ARGUMENT) == 10
        assert store.servicer.quota.used == 0 and store.servicer.quota.held == {}


async def test_announcement_over_the_page_limit_is_refused_at_once(store: Store) -> None:
    async with create_channel(store.address) as ch:
        p = OpenPut(pb_grpc.KVStoreStub(ch), 64 * MiB + 1)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(p.call, 10)  # never released: refused before the stream ends
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert detail_of(e.value).reason == Reason.ERROR_REASON_INVALID_INPUT
        assert store.servicer.put_refused["too_large"] == 1 and store.servicer.quota.used == 0


@pytest.mark.parametrize("store", [dict(max_page_bytes=4 * MiB, max_inflight_put_bytes=8 * MiB)], indirect=True)
async def test_quota_is_charged_as_bytes_arrive_and_freed_as_pages_land(store: Store) -> None:
    async with create_channel(store.address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        a = OpenPut(stub, 3 * MiB, first=2 * MiB)
        await _wait_for(lambda: store.servicer.quota.used == 2 * MiB)
        b = OpenPut(stub, 3 * MiB, first=1 * MiB)
        await _wait_for(lambda: store.servicer.quota.used == 3 * MiB)
        c = OpenPut(stub, 3 * MiB, first=2 * MiB)  # one peer alone holds at most half of the 8 MiB
        assert await asyncio.wait_for(c.outcome(), 10) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert store.servicer.quota.used == 3 * MiB
        a.finish_page = True
        a.release.set()
        resp = await a.outcome()
        assert isinstance(resp, pb.PutResponse) and resp.stored == 1
        assert store.servicer.quota.used == 1 * MiB  # b still holds what it sent
        b.finish_page = True
        b.release.set()
        assert (await b.outcome()).stored == 1
        assert store.servicer.quota.used == 0
        got = await KVStoreClient(ch).get(a.fp, [a.h])
        assert len(got[0].data) == 3 * MiB


@pytest.mark.parametrize("store", [dict(put_idle_timeout_s=0.3)], indirect=True)
async def test_an_idle_put_stream_ends_and_frees_its_quota(store: Store) -> None:
    async with create_channel(store.address) as ch:
        p = OpenPut(pb_grpc.KVStoreStub(ch), 1 * MiB)
        assert await asyncio.wait_for(p.outcome(), 10) == grpc.StatusCode.DEADLINE_EXCEEDED
        p.release.set()
    assert store.servicer.quota.used == 0 and store.servicer.put_refused["idle"] == 1


# --- mTLS: only a prefill writes ------------------------------------------------------------------


def _tls(d: Path, role: str) -> TLSConfig:
    return TLSConfig(tls_cert=str(d / f"{role}.pem"), tls_key=str(d / f"{role}-key.pem"), tls_ca=str(d / "ca.pem"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"))


async def test_with_mtls_only_a_prefill_may_put_delete_or_get(certs: Path, tmp_path: Path) -> None:
    server, s = await _serve(_tls(certs, "kvstore"))
    fp = new_fp()
    data = os.urandom(8 * KiB)
    page = (new_hash(), data, checksum(data))
    try:
        async with create_channel(s.address, tls=_tls(certs, "router")) as ch:
            router = KVStoreClient(ch)
            for call in (router.put(fp, [page]), router.delete(fp, [page[0]])):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert detail_of(e.value).reason == Reason.ERROR_REASON_PERMISSION
            assert (await router.lookup(fp, [page[0]])).num_present == 0  # reads are fine, nothing landed
        async with create_channel(s.address, tls=_tls(certs, "prefill")) as ch:
            prefill = KVStoreClient(ch)
            assert (await prefill.put(fp, [page])).stored == 1
            got = await prefill.get(fp, [page[0]])  # a prefill reads prefixes
            assert got[0].data == data
        # Pages (other users' prompts) are read only by a prefill; the `client` certificate (no role)
        # may not even ask which pages exist.
        for role, calls in (("decode", ("get",)), ("router", ("get",)), ("client", ("get", "lookup"))):
            async with create_channel(s.address, tls=_tls(certs, role)) as ch:
                peer = KVStoreClient(ch)
                for name in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await getattr(peer, name)(fp, [page[0]])
                    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, (role, name)
                    assert detail_of(e.value).reason == Reason.ERROR_REASON_PERMISSION
                    assert "may read the kvstore" in e.value.details()
        # No client certificate: the handshake fails, nothing is answered.
        creds = grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes())
        async with grpc.aio.secure_channel(s.address, creds, options=[
                ("grpc.ssl_target_name_override", DEFAULT_SERVER_NAME)]) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await KVStoreClient(ch).lookup(fp, [page[0]])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # A certificate from another CA (role prefill in its name) is refused the same way.
        other = make_certs(tmp_path / "other", roles=("prefill",))
        async with create_channel(s.address, tls=TLSConfig(
                tls_cert=str(other / "prefill.pem"), tls_key=str(other / "prefill-key.pem"),
                tls_ca=str(certs / "ca.pem"))) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await KVStoreClient(ch).put(fp, [(new_hash(), data, checksum(data))])
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert s.servicer.put_refused["permission"] == 1
    finally:
        await server.stop(0)
        await s.servicer.backend.close()


async def test_one_peer_holds_at_most_its_share_and_another_still_puts(certs: Path) -> None:
    """Peer identity is the certificate's CN: prefill-a floods open Puts; it is stopped at half the quota,
    and prefill-b (another identity) still lands a page while prefill-a's streams stay open."""
    ids = make_certs(certs.parent / "ids", roles=("kvstore", "prefill-a", "prefill-b", "prefill-c"))
    server, s = await _serve(_tls(ids, "kvstore"), max_page_bytes=4 * MiB, max_inflight_put_bytes=8 * MiB)
    try:
        async with create_channel(s.address, tls=_tls(ids, "prefill-a")) as cha, \
                create_channel(s.address, tls=_tls(ids, "prefill-b")) as chb:
            flood = [OpenPut(pb_grpc.KVStoreStub(cha), 4 * MiB, first=1 * MiB) for _ in range(8)]
            await _wait_for(lambda: sum(p.call.done() for p in flood) == 4)
            assert s.servicer.quota.held == {"cn:prefill-a": 4 * MiB}
            assert s.servicer.put_refused["quota"] == 4
            data = os.urandom(3 * MiB)
            assert (await KVStoreClient(chb).put(new_fp(), [(new_hash(), data, checksum(data))])).stored == 1
            # A third identity arriving shrinks every share to 8/3 MiB: prefill-a (over it) takes nothing more.
            async with create_channel(s.address, tls=_tls(ids, "prefill-c")) as chc:
                held_c = OpenPut(pb_grpc.KVStoreStub(chc), 4 * MiB, first=2 * MiB)
                await _wait_for(lambda: s.servicer.quota.held.get("cn:prefill-c") == 2 * MiB)
                more_a = OpenPut(pb_grpc.KVStoreStub(cha), 4 * MiB, first=64 * KiB)
                assert await asyncio.wait_for(more_a.outcome(), 10) == grpc.StatusCode.RESOURCE_EXHAUSTED
                held_c.release.set()
                assert await held_c.outcome() == grpc.StatusCode.INVALID_ARGUMENT
            for p in flood:
                p.release.set()
            await asyncio.gather(*(p.outcome() for p in flood))
        assert s.servicer.quota.used == 0 and s.servicer.quota.held == {}
    finally:
        await server.stop(0)
        await s.servicer.backend.close()
