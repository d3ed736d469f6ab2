"""The prefill service with its step loop in an engine-core process (``--engine-core process``; auto on CPU): the
front maps the core's KV pool and moves the pages itself (services/prefill/engine_port.py). Greedy tokens equal
the in-process engine's over grpc and shm, and a prefill cancelled or a decode gone mid-prompt frees every block,
as with the loop on a thread (test_transports.py's tests, run with ``core``); a handoff failing after the last chunk frees the blocks the core held for
the front, kvstore pages go in
with the admit and come back out through the write-back, a core killed mid-prompt ends the call UNAVAILABLE /
ENGINE_DEAD and takes the service down, and what a core cannot serve is refused in one line (auto: a thread)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
import pytest
from prometheus_client import CollectorRegistry

from services.common.grpc_util import Reason, detail_of, wait_for_serving
from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2_grpc
from services.common.server import StartupError
from services.engine import core_wire as w
from services.engine.core_client import EngineCoreClient, EngineCoreThreadOnly
from services.engine.kv_transport import FakeTransport
from services.engine.kv_transport.fake import Faults
from services.prefill.config import PrefillConfig
from services.prefill.engine_port import CorePrefillEngine
from services.prefill.servicer import PrefillServicer
from services.text.sampling_params import Sampled, TopLogprobs
from services.worker.engine_service import (
    EngineDiedError,
    EngineService,
    engine_core_mode,
    prefill_core_config,
    preflight,
)
from tests.prefill import test_prefill_service as service
from tests.prefill import test_transports as transports
from tests.prefill.conftest import RecordingReceiver, engine_config, prefill_request, start_prefill
from tests.prefill.test_kvstore_outage import Store, _prompt, _reused, _written
from tests.prefill.test_transports import pair

__all__ = ["pair"]  # the fixture, shared with tests/prefill/test_transports.py

SERVER = dict(host="127.0.0.1", port=0, metrics_port=-1, drain_timeout_s=10.0, grace_s=2.0)

SAME_CONTRACT = {
    "every_chunk_carries_the_token": service.test_every_chunk_carries_the_reservation_token,
    "queue_full_is_resource_exhausted": service.test_queue_full_is_resource_exhausted_with_retry_after,
    "deadline_drops_a_queued_request": service.test_deadline_drops_a_queued_request_and_frees_its_blocks,
    "grpc_deadline_mid_compute": service.test_grpc_deadline_drops_the_request_mid_compute,
    "cancelled_frees_everything": service.test_a_cancelled_prefill_frees_everything,
    "handoff_failure_typed": service.test_handoff_failure_is_typed_as_the_decode_side,
    "shm_write_checks_block_ids": service.test_shm_direct_write_lands_the_pages_and_checks_block_ids,
}
"""Prefill tests written against the in-process engine, run again with the engine in its own process."""


@pytest.mark.parametrize("transport", ["grpc", "shm"])  # not mooncake: engine_port.py says why
@pytest.mark.parametrize("case", [transports.test_each_transport_gives_the_in_process_engines_tokens,
                                  transports.test_a_prefill_gone_mid_transfer_keeps_the_reservation_then_abort_frees_it,
                                  transports.test_a_decode_gone_mid_transfer_fails_prefill_as_a_handoff_failure],
                         ids=["tokens", "prefill-gone", "decode-gone"])
async def test_each_transport_holds_as_with_the_loop_on_a_thread(pair, case, transport: str) -> None:
    await case(pair, transport, True)


@pytest.mark.parametrize("case", list(SAME_CONTRACT.values()), ids=list(SAME_CONTRACT))
async def test_the_prefill_contract_holds_with_the_engine_in_its_own_process(make_prefill, case) -> None:
    async def make_core(**kwargs):
        rig = await make_prefill(core=True, **kwargs)
        assert isinstance(rig.servicer.port, CorePrefillEngine)
        return rig

    await case(make_core)


async def test_a_failed_handoff_frees_the_blocks_held_past_the_last_chunk() -> None:
    """Every page leaves after the last chunk (chunked transfer off) and the stream breaks at the first message,
    while the core holds the prompt's blocks for the front: the call fails, and the blocks come back."""
    rig = await start_prefill(config=PrefillConfig(chunked_transfer=False), core=True)
    try:
        rig.faults.fail_after_chunks = 0
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await rig.stub.Prefill(prefill_request(list(range(3, 40))))
        assert detail_of(e.value).reason == Reason.ERROR_REASON_KV_HANDOFF_FAILED
        s = await rig.idle()
        assert s["free_blocks"] == s["total_blocks"] and s["running"] == 0
        rig.faults.fail_after_chunks = -1
        resp = await rig.stub.Prefill(prefill_request(list(range(3, 40)), request_id="again"))
        assert resp.num_prompt_tokens == 37
        s = await rig.idle()
        assert s["free_blocks"] == s["total_blocks"]
    finally:
        for close in rig.closers:
            await close()


async def test_kvstore_pages_go_in_with_the_admit_and_out_through_the_write_back() -> None:
    """Two prefill cores share a kvstore: the first writes its pages back from the mapped pool, the second loads
    them with its admit; both give the first token the in-process engine gives."""
    store = Store()
    await store.start()
    cfg = PrefillConfig(kvstore_address=f"127.0.0.1:{store.port}", kvstore_timeout_s=5.0)
    thread = await start_prefill(engine=engine_config())
    writer = await start_prefill(config=cfg, core=True)
    reader = await start_prefill(config=cfg, core=True)
    try:
        for k in range(3):
            want = (await thread.stub.Prefill(prefill_request(_prompt(k), request_id=f"t{k}"))).first_token
            assert (await writer.stub.Prefill(prefill_request(_prompt(k), request_id=f"w{k}"))).first_token == want
            await _written(store, writer, _prompt(k))
            resp = await reader.stub.Prefill(prefill_request(_prompt(k), request_id=f"r{k}"))
            assert resp.first_token == want and resp.num_cached_tokens == 4 * 16
        assert _reused(reader) == 3 * 4 * 16
        for rig in (writer, reader):
            s = await rig.idle()
            assert s["free_blocks"] == s["total_blocks"]
    finally:
        for rig in (thread, writer, reader):
            for close in rig.closers:
                await close()
        await store.stop()
        await store.backend.close()


async def test_a_core_killed_mid_prompt_ends_the_call_engine_dead_and_takes_the_service_down() -> None:
    config = PrefillConfig(**SERVER, engine_core="process", slowdown_ms_per_chunk=200)
    receiver = RecordingReceiver()
    svc = EngineService("prefill", config, engine_config())
    servicer = PrefillServicer(config, PrefillMetrics(CollectorRegistry()), FakeTransport({"decode-x": receiver},
                                                                                          Faults()), asyncio.Event())
    task = asyncio.create_task(svc.run(servicer, prefill_pb2_grpc.add_PrefillServicer_to_server))
    for _ in range(400):
        if svc.server is not None and svc.server.grpc_port:
            break
        await asyncio.sleep(0.05)
    assert svc.server is not None and svc.server.grpc_port
    await wait_for_serving(svc.server.grpc_address, 60)
    core = svc.engine
    assert isinstance(core, EngineCoreClient)
    channel = grpc.aio.insecure_channel(svc.server.grpc_address)
    try:
        call = prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_request(list(range(3, 120))), timeout=120)
        await asyncio.wait_for(receiver.first_chunk.wait(), 60)  # computing: ~17 chunks at 200 ms each
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert detail_of(e.value).reason == Reason.ERROR_REASON_ENGINE_DEAD, e.value.details()
        with pytest.raises(EngineDiedError, match="exited"):
            await asyncio.wait_for(task, 30)  # the service exits non-zero: its supervisor restarts it
        assert core.proc.poll() is not None
    finally:
        await channel.close()
        if not task.done() and svc.server is not None:
            await svc.server.shutdown("test over", force=True)
        with contextlib.suppress(EngineDiedError):
            await task


async def test_a_model_whose_pages_the_front_cannot_read_is_refused_in_one_line() -> None:
    with pytest.raises(EngineCoreThreadOnly, match="several regions") as e:
        await EngineCoreClient.start(engine_config(draft_model="layers:1"), "prefill", role="prefill")
    assert "\n" not in str(e.value)


def test_auto_runs_a_prefills_loop_in_a_core_unless_it_must_share_this_process() -> None:
    base = PrefillConfig(**SERVER)
    assert base.engine_core == "auto"
    assert engine_core_mode(base, engine_config(), "prefill") == "process"
    # A GPU prefill's core too: its front opens the core's CUDA pool by its IPC handle.
    assert engine_core_mode(base, engine_config(device="cuda"), "prefill") == "process"
    for why, (cfg, ecfg) in {
        "tp": (base, engine_config(tensor_parallel_size=2)),
        "mooncake": (PrefillConfig(**SERVER, kv_transport="mooncake"), engine_config()),
        "draft": (base, engine_config(draft_model="layers:1")),
        "layer groups": (base, engine_config(kv_export_layer_group_cpu=True)),
    }.items():
        assert engine_core_mode(cfg, ecfg, "prefill") == "thread", why
    assert engine_core_mode(PrefillConfig(**SERVER, engine_core="thread"), engine_config(), "prefill") == "thread"
    with pytest.raises(StartupError, match="--engine-core process: not for this prefill: --kv-transport mooncake"):
        preflight(PrefillConfig(**SERVER, engine_core="process", kv_transport="mooncake"), engine_config(),
                  "prefill")


def test_a_gpu_prefill_core_plans_no_layer_group_exports() -> None:
    """Layer-group exports feed only a Mooncake writer, whose prefill loop runs on a thread: a core's engine is
    started without them (on a GPU they are on by default); the CPU testing aid keeps them (the core refuses it)."""
    gpu = engine_config(device="cuda")
    assert gpu.kv_export_layer_group > 0
    assert prefill_core_config(gpu).kv_export_layer_group == 0
    assert prefill_core_config(gpu).device == gpu.device
    cpu_aid = engine_config(kv_export_layer_group_cpu=True)
    assert prefill_core_config(cpu_aid) is cpu_aid


def test_computed_chunks_cross_the_channel_whole() -> None:
    class Seq:
        request_id, num_computed_tokens, num_cached_tokens, block_table = "r/1", 32, 16, [4, 9, 2]

    sampled = Sampled(17, -0.25, TopLogprobs((17, 3), (-0.25, -1.5)))
    body = w.decode_body(w.encode([w.OUT, [], [], [w.chunk_to_wire(Seq, 5, True, sampled)], 1.5])[0][8:])
    chunk, got = w.chunk_from_wire(body[3][0])
    assert (chunk.seq.request_id, chunk.seq.num_computed_tokens, chunk.seq.num_cached_tokens, chunk.seq.block_table,
            chunk.num_new_tokens, chunk.sample) == ("r/1", 32, 16, [4, 9, 2], 5, True)
    assert got == sampled
    assert w.chunk_from_wire(w.chunk_to_wire(Seq, 5, False, None))[1] is None
