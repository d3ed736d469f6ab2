"""The Prefill RPC at its boundary: range checks, a bounded queue, deadlines and cancellation that free
the engine at once, the reservation token on every chunk, and side-transport descriptors refused
without touching anything they name."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import pickle
import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from services.common.grpc_util import Reason, create_channel, detail_of
from services.common.metrics import (
    PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL,
    PREFILL_REQUESTS_ABORTED_TOTAL,
)
from services.common.pb import decode_pb2, prefill_pb2_grpc
from services.common.tls import TLSConfig, make_certs
from services.engine.device_defaults import batch_defaults
from services.engine.shared_kv import SHM_DIR, create_shared_kv, host_id
from services.prefill.config import PrefillConfig
from tests.prefill.conftest import TOKEN, PrefillRig, engine_config, prefill_request

PROMPT = [(i * 37) % 250 + 1 for i in range(45)]  # 45 tokens: 3 pages of 16
LONG = [(i * 53) % 500 + 3 for i in range(300)]  # 43 chunks of 7 tokens


def _aborted(rig: PrefillRig, reason: str) -> float:
    return rig.metric(PREFILL_REQUESTS_ABORTED_TOTAL, reason=reason)


async def _fails(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    return e.value


async def test_every_chunk_carries_the_reservation_token(make_prefill) -> None:
    rig = await make_prefill()
    resp = await rig.stub.Prefill(prefill_request(PROMPT))
    assert resp.num_chunks == len(rig.receiver.chunks) == 3
    assert all(c.reservation_token == TOKEN and c.reservation_id == "resv" for c in rig.receiver.chunks)
    assert rig.receiver.chunks[-1].is_last and rig.receiver.chunks[-1].first_token == resp.first_token


@pytest.mark.parametrize(("overrides", "field"), [
    (dict(token_ids=[*PROMPT[:-1], 512]), "token_ids"),
    (dict(token_ids=[-1, *PROMPT]), "token_ids"),
    (dict(token_ids=[]), "token_ids"),
    (dict(token_ids=[5] * 1024), "token_ids"),
    (dict(num_skip_blocks=4), "num_skip_blocks"),
    (dict(dest_block_ids=[1, 2]), "dest_block_ids"),
    (dict(reservation_token=b""), "reservation_token"),
    (dict(reservation_token=b"x" * 65), "reservation_token"),
    (dict(reservation_id=""), "reservation_id"),
    (dict(request_id="r" * 257), "request_id"),
    (dict(deadline_unix=math.nan), "deadline_unix"),
    (dict(deadline_unix=-5.0), "deadline_unix"),
])
async def test_out_of_range_fields_are_invalid_argument(make_prefill, overrides: dict, field: str) -> None:
    rig = await make_prefill()
    err = await _fails(rig.stub.Prefill(prefill_request(PROMPT, **overrides)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    d = detail_of(err)
    assert (d.reason, d.field, d.side, d.retryable) == (Reason.ERROR_REASON_INVALID_INPUT, field, "prefill", False)
    assert field in err.details()
    assert not rig.receiver.chunks and _aborted(rig, "invalid") == 1
    s = await rig.engine.stats()
    assert s["free_blocks"] == s["total_blocks"]


async def test_queue_full_is_resource_exhausted_with_retry_after(make_prefill) -> None:
    rig = await make_prefill(config=PrefillConfig(max_queued=2))
    rig.receiver.gate = asyncio.Event()  # both requests compute, then wait in their handoff
    held = [asyncio.ensure_future(rig.stub.Prefill(prefill_request(PROMPT, request_id=f"r{i}"))) for i in range(2)]
    for _ in range(200):
        if rig.servicer.inflight == 2:
            break
        await asyncio.sleep(0.02)
    assert rig.servicer.saturated
    err = await _fails(rig.stub.Prefill(prefill_request(PROMPT, request_id="r2")))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-queued" in err.details()
    d = detail_of(err)
    assert (d.reason, d.retryable, d.side) == (Reason.ERROR_REASON_OVERLOADED, True, "prefill")
    assert d.retry_after_ms > 0 and _aborted(rig, "overloaded") == 1
    rig.receiver.gate.set()
    first = await asyncio.gather(*held)
    assert first[0].first_token == first[1].first_token
    assert (await rig.stub.Prefill(prefill_request(PROMPT, request_id="r3"))).first_token == first[0].first_token
    assert rig.servicer.inflight == 0


async def test_deadline_drops_a_queued_request_and_frees_its_blocks(make_prefill) -> None:
    """One running slot: the second request queues behind a slow first one and its deadline passes."""
    # The slow one holds the only slot for >= 43 chunks x 100 ms; the late one's deadline (1.5 s) passes while it
    # queues, long before that (no wall-clock assert: a loaded host only stretches both).
    rig = await make_prefill(config=PrefillConfig(slowdown_ms_per_chunk=100), engine=engine_config(max_num_seqs=1))
    slow = asyncio.ensure_future(rig.stub.Prefill(prefill_request(LONG, request_id="slow")))
    await rig.receiver.first_chunk.wait()
    late = asyncio.ensure_future(rig.stub.Prefill(prefill_request(PROMPT, request_id="late",
                                                                  deadline_unix=time.time() + 1.5)))
    for _ in range(100):
        if (await rig.engine.stats())["waiting"] == 1 or late.done():
            break
        await asyncio.sleep(0.02)
    assert (await rig.engine.stats())["waiting"] == 1  # queued behind the slow one
    err = await _fails(late)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and detail_of(err).reason == Reason.ERROR_REASON_DEADLINE
    s = await rig.engine.stats()
    assert s["waiting"] == 0 and s["running"] == 1 and not slow.done()  # dropped from the queue, slow still running
    assert _aborted(rig, "deadline") == 1
    await slow
    s = await rig.idle()
    assert s["free_blocks"] == s["total_blocks"]
    assert not any(c.request_id == "late" for c in rig.receiver.chunks)


async def test_grpc_deadline_drops_the_request_mid_compute(make_prefill) -> None:
    rig = await make_prefill(config=PrefillConfig(slowdown_ms_per_chunk=40))
    computed: list[int] = []  # chunks the engine computed for any request (43 for LONG if never dropped)
    rig.servicer.port.listen(lambda ch, sampled, start: computed.append(ch.num_new_tokens))
    err = await _fails(rig.stub.Prefill(prefill_request(LONG), timeout=0.5))  # ~43 chunks x >= 40 ms
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    s = await rig.idle(timeout_s=30.0)
    assert s["free_blocks"] == s["total_blocks"] and s["running"] == 0, s
    # Dropped at the deadline, not computed to the end: fewer chunks than the prompt has. (Each chunk
    # sleeps 40 ms after it is computed, so 0.5 s allows at most ~12 of the 43, however fast the CPU.)
    assert 0 < len(computed) < 43, computed
    assert rig.servicer.inflight == 0
    # grpc.aio cancels the handler when the call's own deadline fires: counted as a deadline, not a cancel
    assert _aborted(rig, "deadline") == 1 and _aborted(rig, "cancelled") == 0


async def test_a_deadline_already_past_is_refused_before_any_work(make_prefill) -> None:
    rig = await make_prefill()
    err = await _fails(rig.stub.Prefill(prefill_request(PROMPT, deadline_unix=time.time() - 1)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not rig.receiver.chunks


async def test_a_cancelled_prefill_frees_everything(make_prefill) -> None:
    rig = await make_prefill(config=PrefillConfig(slowdown_ms_per_chunk=40))
    computed: list[int] = []
    rig.servicer.port.listen(lambda ch, sampled, start: computed.append(ch.num_new_tokens))
    call = rig.stub.Prefill(prefill_request(LONG))
    await rig.receiver.first_chunk.wait()  # the first chunk's pages went out: mid-compute
    call.cancel()
    s = await rig.idle(timeout_s=30.0)
    assert s["free_blocks"] == s["total_blocks"] and s["running"] + s["waiting"] == 0, s
    assert 0 < len(computed) < 43, computed  # dropped when cancelled, not computed to its last chunk
    for _ in range(50):
        if rig.servicer.inflight == 0:
            break
        await asyncio.sleep(0.02)
    assert rig.servicer.inflight == 0 and not rig.servicer.streams and _aborted(rig, "cancelled") == 1


async def test_handoff_failure_is_typed_as_the_decode_side(make_prefill) -> None:
    rig = await make_prefill()
    rig.faults.fail_after_chunks = 1
    err = await _fails(rig.stub.Prefill(prefill_request(PROMPT)))
    d = detail_of(err)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert (d.reason, d.retryable, d.side) == (Reason.ERROR_REASON_KV_HANDOFF_FAILED, False, "decode")
    assert _aborted(rig, "kv_handoff") == 1
    s = await rig.idle()
    assert s["free_blocks"] == s["total_blocks"]


# --- side-transport descriptors -------------------------------------------------------------------


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


async def test_shm_descriptor_naming_a_symlink_falls_back_and_writes_nothing(make_prefill, tmp_path: Path) -> None:
    rig = await make_prefill(config=PrefillConfig(kv_transport="shm"))
    kv = rig.engine.engine.runner.kv_cache
    victim = tmp_path / "victim"
    victim.write_bytes(os.urandom(kv.numel() * kv.element_size()))
    before = _digest(victim)
    name = f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    os.symlink(victim, os.path.join(SHM_DIR, name))
    try:
        dest = decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name=name, shape=list(kv.shape), dtype="float32",
                                                               host_id=host_id()))
        resp = await rig.stub.Prefill(prefill_request(PROMPT, destination=dest, dest_block_ids=[0, 1, 2]))
    finally:
        os.unlink(os.path.join(SHM_DIR, name))
    assert _digest(victim) == before
    assert resp.kv_bytes_sent == 3 * rig.servicer.layout.page_bytes
    assert all(c.transport == "fake" for c in rig.receiver.chunks) and sum(c.num_pages for c in rig.receiver.chunks) == 3
    assert len(b"".join(c.payload for c in rig.receiver.chunks)) == resp.kv_bytes_sent  # bytes in the stream
    assert rig.metric(PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL, transport="shm", reason="file") == 1
    # A path for a name is refused the same way.
    await rig.stub.Prefill(prefill_request(PROMPT, request_id="r2", dest_block_ids=[0, 1, 2], destination=(
        decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name=f"../..{victim}", shape=list(kv.shape),
                                                        dtype="float32", host_id=host_id())))))
    assert rig.metric(PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL, transport="shm", reason="name") == 1
    assert _digest(victim) == before


class _Mkdir:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


async def test_cuda_ipc_descriptor_with_a_pickle_payload_runs_nothing(make_prefill, tmp_path: Path) -> None:
    rig = await make_prefill(config=PrefillConfig(kv_transport="cuda-ipc"))
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Mkdir(str(marker)))
    kv = rig.engine.engine.runner.kv_cache
    for handle in (payload, payload[:64].ljust(64, b".")):
        dest = decode_pb2.KVDestination(cuda_ipc=decode_pb2.CudaIpcPool(
            host_id=host_id(), device=0, handle=handle, storage_bytes=kv.numel() * 4, shape=list(kv.shape),
            dtype="float32", ref_counter_handle=payload[:40], event_handle=payload))
        resp = await rig.stub.Prefill(prefill_request(PROMPT, destination=dest, dest_block_ids=[0, 1, 2]))
        assert resp.kv_bytes_sent == 3 * rig.servicer.layout.page_bytes
    assert not marker.exists()
    assert sum(rig.metric(PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL, transport="cuda-ipc", reason=r)
               for r in ("handle", "device", "cuda")) == 2


async def test_shm_direct_write_lands_the_pages_and_checks_block_ids(make_prefill) -> None:
    rig = await make_prefill(config=PrefillConfig(kv_transport="shm"))
    kv = rig.servicer.pages.pool  # the engine's pool (mapped, when the loop runs in an engine core)
    shape = (kv.shape[0], 2, 8, *kv.shape[3:])
    pool, path, dest = create_shared_kv(shape, kv.dtype)
    try:
        err = await _fails(rig.stub.Prefill(prefill_request(PROMPT, destination=dest, dest_block_ids=[7, 8, 1])))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and detail_of(err).field == "dest_block_ids"
        resp = await rig.stub.Prefill(prefill_request(PROMPT, destination=dest, dest_block_ids=[6, 2, 4]))
        assert resp.kv_bytes_sent == 3 * rig.servicer.layout.page_bytes
        direct = [c for c in rig.receiver.chunks if c.transport == "shm"]
        assert direct and not any(c.payload for c in direct) and all(c.reservation_token == TOKEN for c in direct)
        # The same prompt as bytes in the stream: the pages equal what landed in the pool.
        rig.receiver.chunks.clear()
        rig.servicer.direct.mode = "grpc"
        await rig.stub.Prefill(prefill_request(PROMPT, request_id="bytes"))
        raw = b"".join(c.payload for c in rig.receiver.chunks)
        pages = torch.frombuffer(bytearray(raw), dtype=kv.dtype).view(3, kv.shape[0], 2, *kv.shape[3:])
        # Full pages came from the prefix cache (the same bytes); the partial last one was recomputed in
        # other chunks (float rounding may differ) and only its 45 - 32 = 13 prompt positions are KV.
        assert torch.equal(pool[:, :, 6], pages[0]) and torch.equal(pool[:, :, 2], pages[1])
        assert torch.allclose(pool[:, :, 4, :13], pages[2][:, :, :13], atol=1e-5)
        assert pool[:, :, 4].abs().sum() > 0
        assert pool[:, :, [0, 1, 3, 5, 7]].abs().sum() == 0  # nothing else was written
    finally:
        os.unlink(path)


async def test_with_mtls_only_the_router_may_call_prefill(make_prefill, tmp_path: Path) -> None:
    certs = make_certs(tmp_path)

    def tls(role: str) -> TLSConfig:
        return TLSConfig(tls_cert=str(certs / f"{role}.pem"), tls_key=str(certs / f"{role}-key.pem"),
                         tls_ca=str(certs / "ca.pem"))

    server_tls = tls("prefill")
    cfg = PrefillConfig(tls_cert=server_tls.tls_cert, tls_key=server_tls.tls_key, tls_ca=server_tls.tls_ca)
    rig = await make_prefill(config=cfg, server_tls=server_tls)
    async with create_channel(rig.address, tls=tls("decode")) as ch:
        err = await _fails(prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_request(PROMPT)))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert detail_of(err).reason == Reason.ERROR_REASON_PERMISSION
    async with create_channel(rig.address, tls=tls("router")) as ch:
        resp = await prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_request(PROMPT))
        assert resp.num_prompt_tokens == len(PROMPT)


async def test_the_queue_bound_is_the_devices_default_unless_given(make_prefill) -> None:
    """--max-queued 0 (the default) takes the bound engine's device row: 64 on CPU; 1024 on CUDA, where a
    C256-C512 burst must queue, not be refused."""
    rig = await make_prefill(config=PrefillConfig())
    assert rig.servicer.max_queued == batch_defaults("cpu").prefill_queue == 64
    assert batch_defaults("cuda:0").prefill_queue == 1024 and batch_defaults("cuda").decode_pending == 1024
    given = await make_prefill(config=PrefillConfig(max_queued=3))
    assert given.servicer.max_queued == 3
