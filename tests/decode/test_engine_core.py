"""The decode service with its step loop in an engine-core process (``--engine-core process``): the same
contract as the in-process engine thread (tokens, per-step batches, cancel, abort, client disconnect, page
bytes over the channel, blocks back to baseline), a clear end when the core dies, a clear refusal of what the
core does not take, and a channel that refuses malformed frames."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import ConfigError
from services.common.grpc_util import Reason
from services.common.pb import common_pb2, decode_pb2
from services.common.server import StartupError
from services.decode.config import DecodeConfig
from services.engine import core_wire as w
from services.engine.core_client import EngineCoreClient, EngineCoreStartError
from services.engine.engine import RequestOutput
from services.engine.sequence import FinishReason
from services.text.sampling_params import SamplingParams, TopLogprobs
from services.worker.engine_service import EngineDiedError, engine_core_mode, preflight
from tests.decode import test_kv_handoff as handoff
from tests.decode import test_step_stream as step_stream
from tests.decode.conftest import SERVER
from tests.decode.kv_util import ecfg, generate, idle, prompt

P = common_pb2.SamplingParams

SAME_CONTRACT = {
    "per_step_batches_keep_order_finish_usage": step_stream.test_many_requests_share_one_stream_with_their_own_order_finish_and_usage,
    "a_refused_request_fails_alone": step_stream.test_a_refused_request_fails_alone_with_its_status_and_detail,
    "cancel_frees_at_once": step_stream.test_leaving_a_request_cancels_it_at_once_and_its_neighbours_run_on,
    "the_stream_going_away_frees_all": step_stream.test_the_stream_going_away_frees_every_request_on_it,
    "kv_imported_tokens": step_stream.test_a_reserved_request_streams_its_kv_imported_tokens,
    "abort_ends_the_reservation": step_stream.test_a_reservation_ended_by_abort_fails_its_entry_cancelled,
    "protocol_violations_free": handoff.test_protocol_violations_free_the_reservation,
    "bad_first_token_refused": handoff.test_huge_first_token_is_refused_and_the_engine_keeps_serving,
}
"""Decode tests written against the in-process engine, run again with the engine in its own process."""


@pytest.mark.parametrize("case", list(SAME_CONTRACT.values()), ids=list(SAME_CONTRACT))
async def test_the_decode_contract_holds_with_the_engine_in_its_own_process(decode_rig, case):
    async def rig(**kw):
        rig = await decode_rig(engine_core="process", **kw)
        assert not rig.engine.in_process
        return rig

    await case(rig)


@pytest.mark.parametrize("how", ["cancelled", "closed_early"])
async def test_a_broken_kv_stream_is_kept_for_a_retry_with_the_engine_in_its_own_process(decode_rig, how):
    await handoff.test_broken_stream_keeps_the_reservation_for_a_fresh_stream(
        lambda **kw: decode_rig(engine_core="process", **kw), how)


async def test_tokens_and_logprobs_equal_the_in_process_engine(decode_rig):
    thread = await decode_rig(mode="colocated")
    core = await decode_rig(mode="colocated", engine_core="process")
    for i in range(3):
        req = decode_pb2.DecodeGenerateRequest(request_id=f"q{i}", token_ids=prompt(i, 20 + 7 * i), params=P(
            max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=3))
        got = [m async for m in core.stub.Generate(req, timeout=60)]
        want = [m async for m in thread.stub.Generate(req, timeout=60)]
        assert [t for m in got for t in m.token_ids] == [t for m in want for t in m.token_ids]
        lp_got = [x for m in got for x in m.logprobs]
        lp_want = [x for m in want for x in m.logprobs]
        assert len(lp_got) == 12 and lp_got == pytest.approx(lp_want, abs=1e-5)
        assert [list(t.token_ids) for m in got for t in m.top_logprobs] == \
            [list(t.token_ids) for m in want for t in m.top_logprobs]
        assert got[-1].usage.completion_tokens == want[-1].usage.completion_tokens == 12


async def test_a_core_killed_mid_stream_ends_every_stream_and_takes_the_service_down(decode_service):
    svc = await decode_service(mode="colocated", engine_core="process")
    core = svc.engine
    assert isinstance(core, EngineCoreClient)
    seen: list[int] = []

    async def watch():
        try:
            async for resp in health_pb2_grpc.HealthStub(svc.channel).Watch(health_pb2.HealthCheckRequest()):
                seen.append(resp.status)
        except grpc.aio.AioRpcError:
            pass

    watcher = asyncio.create_task(watch())
    outcomes: list[tuple[int, grpc.StatusCode, int]] = []
    started = asyncio.Event()

    async def run(i: int) -> None:
        n = 0
        try:
            async for m in svc.stub.Generate(decode_pb2.DecodeGenerateRequest(
                    request_id=f"k{i}", token_ids=prompt(i), params=P(max_tokens=4000, temperature=0,
                                                                         ignore_eos=True)), timeout=120):
                n += len(m.token_ids)
                started.set()
        except grpc.aio.AioRpcError as e:
            from services.common.grpc_util import detail_of

            outcomes.append((n, e.code(), detail_of(e).reason))
            return
        outcomes.append((n, grpc.StatusCode.OK, 0))

    runs = [asyncio.create_task(run(i)) for i in range(3)]
    await asyncio.wait_for(started.wait(), 60)
    os.kill(core.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*runs), 60)
    assert len(outcomes) == 3
    for _n, code, reason in outcomes:  # every open stream: UNAVAILABLE / ENGINE_DEAD, none silently cut short
        assert code == grpc.StatusCode.UNAVAILABLE and reason == Reason.ERROR_REASON_ENGINE_DEAD
    with pytest.raises(EngineDiedError, match="exited"):
        await asyncio.wait_for(svc.task, 30)  # the service exits non-zero: its supervisor restarts it
    await asyncio.wait_for(watcher, 10)
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    assert core.proc.poll() is not None


async def test_a_model_that_cannot_load_is_one_line_and_leaves_no_process():
    with pytest.raises(EngineCoreStartError, match="no-such-shape") as e:
        await EngineCoreClient.start(ecfg(model="random:no-such-shape"), "decode")
    assert "\n" not in str(e.value)


async def test_a_core_stopped_cleanly_exits_zero_and_refuses_further_commands(decode_rig):
    rig = await decode_rig(mode="colocated", engine_core="process")
    core = rig.engine
    base = await idle(core)
    outs = [o async for o in core.generate(prompt(5), SamplingParams(max_tokens=3, temperature=0), "g",
                                           detokenize=False)]
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finished
    assert (await idle(core))["free_blocks"] == base["free_blocks"]
    await asyncio.to_thread(core.shutdown)
    assert core.proc.returncode == 0
    for _ in range(100):
        if core.dead is not None:
            break
        await asyncio.sleep(0.05)
    _, _, out = await generate(rig.stub, decode_pb2.DecodeGenerateRequest(
        request_id="after", token_ids=prompt(6), params=P(max_tokens=2, temperature=0)))
    assert out.code == grpc.StatusCode.UNAVAILABLE and out.detail.reason == Reason.ERROR_REASON_ENGINE_DEAD


def test_what_the_core_does_not_take_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--engine-core.*not with --kv-mooncake-host"):
        DecodeConfig(**{**SERVER, "engine_core": "process", "kv_mooncake_host": "127.0.0.1"})
    with pytest.raises(StartupError, match="--engine-core process: not with --tensor-parallel-size"):
        preflight(DecodeConfig(**{**SERVER, "engine_core": "process"}), ecfg(tensor_parallel_size=2))


def test_auto_runs_the_loop_in_a_process_unless_this_process_must_hold_it():
    """auto: an engine-core process, except beside a Mooncake-registered pool or tensor-parallel ranks."""
    base = {k: v for k, v in SERVER.items() if k != "engine_core"}
    assert DecodeConfig(**base).engine_core == "auto"
    assert engine_core_mode(DecodeConfig(**base), ecfg()) == "process"
    assert engine_core_mode(DecodeConfig(**base, kv_mooncake_host="127.0.0.1"), ecfg()) == "thread"
    assert engine_core_mode(DecodeConfig(**base), ecfg(tensor_parallel_size=2)) == "thread"
    assert engine_core_mode(DecodeConfig(**base, engine_core="thread"), ecfg()) == "thread"


def test_the_channel_carries_outputs_whole_and_refuses_malformed_frames():
    o = RequestOutput("r1", [5, 6], "ab", [-0.5, -1.25], [TopLogprobs((5, 7), (-0.5, -2.0)), None], True,
                      FinishReason.LENGTH, 10, 4, 2, 123.5, 3, 1, False)
    assert w.output_from_wire(w.output_to_wire(o)) == o
    p = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop=["x"], stop_token_ids=[2],
                       ignore_eos=True, logprobs=True, top_logprobs=2)
    assert w.params_from_wire(w.params_to_wire(p)) == p
    with pytest.raises(w.WireError, match="bad frame header"):
        w.decode_header(w.HEADER.pack(w.MAX_BODY + 1, 0))
    with pytest.raises(w.WireError, match="bad frame header"):
        w.decode_header(w.HEADER.pack(0, 0))
    with pytest.raises(w.WireError, match="does not parse"):
        w.decode_body(b"\xc1")
    with pytest.raises(w.WireError, match="typed list"):
        w.decode_body(w.encode([])[0][w.HEADER.size:])


async def test_the_pending_bound_is_the_devices_default_unless_given(decode_rig):
    """--max-pending 0 (the default) takes the bound engine's device row (256 on CPU), in either front."""
    base = {k: v for k, v in SERVER.items() if k != "engine_core"}
    assert DecodeConfig(**base).max_pending == 0
    thread = await decode_rig(engine_core="thread")
    core = await decode_rig(engine_core="process", max_pending=7)
    assert thread.servicer.max_pending == 256 and core.servicer.max_pending == 7
    assert core.engine.device == "cpu"
