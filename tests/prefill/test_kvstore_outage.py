"""kvstore down: prefill serves without reuse (counted) and reuse resumes when the store is back.

Two prefill engines share an in-process kvstore: the first computes prompts and writes their pages
back; the second finds them there (cached prefix source "kvstore") unless the store is down."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.grpc_util import server_options
from services.common.metrics import PREFILL_CACHED_PREFIX_TOKENS_TOTAL, PREFILL_KVSTORE_ERRORS_TOTAL
from services.common.pb import kvstore_pb2_grpc
from services.kvstore.embedded import EmbeddedBackend
from services.kvstore.servicer import KVStoreServicer
from services.prefill.config import PrefillConfig
from tests.prefill.conftest import PrefillRig, prefill_request

MiB = 1 << 20
N_PROMPTS = 16


def _prompt(k: int) -> list[int]:
    return [(i * 31 + 7 * k) % 500 + 2 for i in range(70)]  # 4 full pages + 6 tokens


class Store:
    """An in-process kvstore whose server can be stopped and started again on the same port."""

    def __init__(self) -> None:
        self.backend = EmbeddedBackend(memory_bytes=64 * MiB)
        self.servicer = KVStoreServicer(self.backend, max_page_bytes=4 * MiB)
        self.port = 0
        self.server: grpc.aio.Server | None = None

    async def start(self) -> None:
        self.server = grpc.aio.server(options=server_options())
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None
        await self.server.stop(0)
        self.server = None


def _reused(rig: PrefillRig) -> float:
    return rig.metric(PREFILL_CACHED_PREFIX_TOKENS_TOTAL, model=rig.servicer.model, source="kvstore")


async def _written(store: Store, rig: PrefillRig, prompt: list[int]) -> None:
    """Wait until the prompt's full pages reached the store (write-back runs in the background)."""
    hashes = rig.servicer.kvstore.hashes(prompt)
    fp = rig.servicer.layout.fingerprint
    for _ in range(200):
        if len(await store.backend.locate(fp, hashes)) == len(hashes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("write-back did not land")


async def test_kvstore_outage_then_recovery(make_prefill) -> None:
    store = Store()
    await store.start()
    cfg = dict(kvstore_address=f"127.0.0.1:{store.port}", kvstore_retry_s=0.2, kvstore_timeout_s=1.0)
    writer = await make_prefill(config=PrefillConfig(**cfg))
    reader = await make_prefill(config=PrefillConfig(**cfg))
    try:
        firsts = {}
        for k in range(N_PROMPTS):
            firsts[k] = (await writer.stub.Prefill(prefill_request(_prompt(k), request_id=f"w{k}"))).first_token
            await _written(store, writer, _prompt(k))
        resp = await reader.stub.Prefill(prefill_request(_prompt(0), request_id="r0"))
        assert resp.first_token == firsts[0] and _reused(reader) == 4 * 16  # reuse works

        await store.stop()
        resp = await reader.stub.Prefill(prefill_request(_prompt(1), request_id="r1"))
        assert resp.first_token == firsts[1] and resp.num_cached_tokens == 0  # served, computed in full
        errors = sum(reader.metric(PREFILL_KVSTORE_ERRORS_TOTAL, reason=r) for r in ("lookup", "get", "down"))
        assert errors >= 1 and _reused(reader) == 4 * 16
        resp = await reader.stub.Prefill(prefill_request(_prompt(2), request_id="r2"))  # still served
        assert resp.first_token == firsts[2]

        await store.start()
        deadline = time.monotonic() + 15.0
        k = 3
        while _reused(reader) == 4 * 16:
            assert k < N_PROMPTS and time.monotonic() < deadline, "reuse did not resume after the kvstore came back"
            resp = await reader.stub.Prefill(prefill_request(_prompt(k), request_id=f"r{k}"))
            assert resp.first_token == firsts[k]
            k += 1
            await asyncio.sleep(0.4)  # the channel reconnects within its backoff (at most ~2.4 s)
        assert _reused(reader) == 2 * 4 * 16 and resp.num_cached_tokens == 4 * 16
    finally:
        if store.server is not None:
            await store.stop()
        await store.backend.close()


async def test_write_back_without_room_copies_nothing(make_prefill) -> None:
    """A writer whose pending write-backs are at their bound skips a finished prompt's pages on the engine
    thread (no page export for the kvstore, counted as dropped); with room again the next prompt is written."""
    store = Store()
    await store.start()
    rig = await make_prefill(config=PrefillConfig(kvstore_address=f"127.0.0.1:{store.port}",
                                                  kvstore_max_pending_writes=1, kvstore_write_back_bytes=16 * MiB))
    kv = rig.servicer.kvstore
    assert await kv.writer.wait_up()
    exported: list[int] = []
    real_export = rig.servicer.pages.export

    def counting_export(block_ids, *args, **kwargs):
        exported.append(len(block_ids))
        return real_export(block_ids, *args, **kwargs)

    rig.servicer.pages.export = counting_export
    held = await rig.engine.call(kv.write_back_begin, [0])  # one write-back "under way" (its span out): no room
    assert not isinstance(held, str) and exported == [1]
    try:
        dropped = rig.metric(PREFILL_KVSTORE_ERRORS_TOTAL, reason="write_back_dropped")
        await rig.stub.Prefill(prefill_request(_prompt(0), request_id="full"))
        # the chunks' own exports to decode are of 1-2 pages; the kvstore's would be the prompt's 4 full pages
        assert 4 not in exported[1:] and exported[1:]
        assert rig.metric(PREFILL_KVSTORE_ERRORS_TOTAL, reason="write_back_dropped") == dropped + 1
        assert not await store.backend.locate(rig.servicer.layout.fingerprint, kv.hashes(_prompt(0)))

        kv.write_back_abandon(held)  # its span goes back unwritten
        for _ in range(200):
            if kv.writer.ring.free_bytes == kv.writer.ring.capacity:
                break
            await asyncio.sleep(0.01)
        exported.clear()
        await rig.stub.Prefill(prefill_request(_prompt(1), request_id="room"))
        assert exported.count(4) == 1  # the four full pages, exported once for the store
        await _written(store, rig, _prompt(1))
    finally:
        await store.stop()
        await store.backend.close()
