"""The decode service's lifecycle in-process (EngineService + DecodeServicer on a real server): load
reports never wait on a step, engine death takes the service down non-zero, SIGTERM-style drain lets
in-flight generations finish."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from services.decode.config import DecodeConfig
from services.worker.engine_service import EXIT_ENGINE_DEAD, EngineDiedError, service_main
from tests.decode import kv_util
from tests.decode.kv_util import PROMPT, chunks, generate, idle, prompt, push, reference, refused, reserve

P = common_pb2.SamplingParams


def _gate_steps(monkeypatch, engine) -> threading.Event:
    """Every engine step waits for the returned event (at most 30 s): a step that takes 'seconds'."""
    gate = threading.Event()
    kv_util.slow_steps(monkeypatch, engine.engine, lambda: gate.wait(30))
    return gate


async def test_get_load_and_health_answer_while_a_step_runs_for_seconds(decode_service, monkeypatch):
    svc = await decode_service(mode="colocated", max_pending=8)
    gate = _gate_steps(monkeypatch, svc.engine)
    stream = asyncio.create_task(generate(svc.stub, decode_pb2.DecodeGenerateRequest(
        request_id="slow", token_ids=PROMPT, params=P(max_tokens=3, temperature=0))))
    try:
        rep = None
        for _ in range(100):  # each GetLoad must answer within the router's 1 s bound
            rep = await svc.admin.GetLoad(common_pb2.GetLoadRequest(), timeout=1.0)
            if rep.step_running_s > 0:
                break
            await asyncio.sleep(0.02)
        assert rep is not None and rep.step_running_s > 0  # answered from inside a running step
        assert abs(rep.published_unix - time.time()) < 30 and rep.max_waiting == 8 and not rep.saturated
        status = await health_pb2_grpc.HealthStub(svc.channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
    tokens, _, out = await stream
    assert out.code == grpc.StatusCode.OK and len(tokens) >= 1
    rep = await svc.admin.GetLoad(common_pb2.GetLoadRequest(), timeout=1.0)
    s = await idle(svc.engine)
    assert s["free_blocks"] == s["total_blocks"] and rep.total_blocks == s["total_blocks"]


async def test_engine_death_goes_not_serving_ends_streams_and_exits_non_zero(decode_service, monkeypatch):
    svc = await decode_service(mode="colocated")
    seen: list[int] = []
    watching = asyncio.Event()

    async def watch():
        try:
            async for resp in health_pb2_grpc.HealthStub(svc.channel).Watch(health_pb2.HealthCheckRequest()):
                seen.append(resp.status)
                watching.set()
        except grpc.aio.AioRpcError:
            pass

    watcher = asyncio.create_task(watch())
    await asyncio.wait_for(watching.wait(), 10)

    def boom():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(svc.engine.engine, "step", boom)
    _, _, out = await generate(svc.stub, decode_pb2.DecodeGenerateRequest(
        request_id="x", token_ids=PROMPT, params=P(max_tokens=3)))
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_ENGINE_DEAD
    with pytest.raises(EngineDiedError):
        await asyncio.wait_for(svc.task, 30)
    await asyncio.wait_for(watcher, 10)
    assert seen[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen


def test_service_main_exits_non_zero_when_the_engine_died():
    async def amain(cfg: DecodeConfig, ecfg) -> None:
        raise EngineDiedError("decode: engine loop died: RuntimeError()")

    assert service_main("decode", DecodeConfig, amain, ["--port", "0", "--model", "random:tiny-llama"],
                        "test") == EXIT_ENGINE_DEAD


async def test_drain_finishes_in_flight_generations_and_refuses_new_work(decode_service, monkeypatch):
    svc = await decode_service(mode="colocated", drain_timeout_s=30.0)
    ref = reference(PROMPT, 6)
    kv_util.slow_steps(monkeypatch, svc.engine.engine, lambda: time.sleep(0.02))
    # A colocated generation and a reservation (Generate open, KV not yet sent) are in flight.
    colocated = asyncio.create_task(generate(svc.stub, decode_pb2.DecodeGenerateRequest(
        request_id="c", token_ids=prompt(4), params=P(max_tokens=40, temperature=0, ignore_eos=True))))
    resv = await reserve(svc.stub)
    disagg = asyncio.create_task(generate(svc.stub, decode_pb2.DecodeGenerateRequest(
        reservation_id=resv.reservation_id)))
    for _ in range(200):
        if svc.servicer.generating == 2:
            break
        await asyncio.sleep(0.02)
    assert svc.servicer.generating == 2
    assert svc.service.server is not None
    shutdown = asyncio.create_task(svc.service.server.shutdown("SIGTERM"))
    await asyncio.sleep(0.1)
    out = await refused(reserve(svc.stub, prompt(8)))
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_DRAINING
    # The existing reservation is still served: its KV arrives during the drain and it completes.
    assert (await push(svc.stub, chunks(resv, PROMPT, ref))).code == grpc.StatusCode.OK
    tokens, reason, out = await disagg
    assert out.code == grpc.StatusCode.OK and tokens == ref.tokens
    tokens, reason, out = await colocated
    assert out.code == grpc.StatusCode.OK and reason == common_pb2.FINISH_REASON_LENGTH and len(tokens) == 40
    await shutdown
    await asyncio.wait_for(svc.task, 30)  # returns normally: exit status 0
