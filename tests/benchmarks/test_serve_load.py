"""The load generator against a scripted server: every failure is counted by kind, never dropped;
concurrency, rate, duration and multi-turn history behave as documented."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestServer

from benchmarks.serve.client import Target
from benchmarks.serve.load import TRACE_RATE, LoadPoint, Runner
from benchmarks.serve.report import summarize_run
from benchmarks.serve.stats import SLO
from benchmarks.serve.tokens import TokenCounter
from benchmarks.serve.workload import Conversation, Turn, trace_workload
from tests.benchmarks.fake_openai import app


@pytest.fixture
async def server():
    srv = TestServer(app(), host="127.0.0.1")
    await srv.start_server()
    yield srv
    await srv.close()


def _target(server, api: str = "chat") -> Target:
    return Target(f"http://127.0.0.1:{server.port}/v1", "fake-model", api, timeout_s=10)


def _one(cid: str, text: str, n: int = 3) -> Conversation:
    return Conversation(cid, (Turn(text, n),))


async def test_failed_requests_are_counted_by_kind(server):
    convs = [_one("ok-0", "hello there"), _one("f503", "FAIL503 please"), _one("mid", "MIDSTREAM now"),
             _one("trunc", "TRUNCATE it"), _one("empty", "EMPTY answer"), _one("ok-1", "hi again", 5)]
    run = await Runner(_target(server), TokenCounter(None), progress=False).run(
        trace_workload(convs), LoadPoint(concurrency=3))
    s = summarize_run(run, SLO(), num_gpus=2)
    assert s["requests"]["sent"] == 6 and s["requests"]["completed"] == 2 and s["requests"]["failed"] == 4
    assert s["requests"]["errors"] == {"http_503": 1, "stream_error": 1, "incomplete": 1, "empty": 1}
    assert "decode died" in s["requests"]["error_examples"]["stream_error"]
    # Tokens count completed requests, from usage: 3 + 5 out, 2 + 2 words in.
    assert s["tokens"] == {"input": 4, "output": 8, "source": "usage", "client_tokenizer_input": None,
                           "client_tokenizer_output": None}
    assert s["throughput"]["output_tok_s_per_gpu"] == pytest.approx(s["throughput"]["output_tok_s"] / 2)
    assert s["goodput"]["requests"] == 2 and s["goodput"]["fraction_of_sent"] == pytest.approx(2 / 6)
    by_id = {r.conversation: r for r in run.results}
    assert by_id["ok-1"].ttft is not None and len(by_id["ok-1"].itls()) == 4


async def test_tokens_that_form_no_text_complete_without_token_times(server):
    """A completion whose usage counts tokens but whose stream carried no text is completed (its tokens count),
    with no TTFT: the client saw none arrive."""
    run = await Runner(_target(server, "completions"), TokenCounter(None), progress=False).run(
        trace_workload([_one("nt", "NOTEXT please", 4), _one("ok", "hello", 2)]), LoadPoint(concurrency=2))
    by_id = {r.conversation: r for r in run.results}
    assert by_id["nt"].ok and not by_id["nt"].error and by_id["nt"].ttft is None
    s = summarize_run(run, SLO())
    assert s["requests"]["completed"] == 2 and s["requests"]["errors"] == {}
    assert s["tokens"]["output"] == 6 and s["ttft_s"]["count"] == 1


async def test_connection_refused_and_timeouts_are_counted():
    target = Target("http://127.0.0.1:9", "m", timeout_s=2)  # discard port: nothing listens
    run = await Runner(target, TokenCounter(None), progress=False).run(
        trace_workload([_one("a", "x"), _one("b", "y")]), LoadPoint(concurrency=2))
    assert [r.error for r in run.results] == ["connection", "connection"]
    assert summarize_run(run, SLO())["requests"]["failed"] == 2


async def test_multi_turn_sends_history_and_stops_after_a_failure(server):
    convs = [Conversation("c0", (Turn("one", 2), Turn("two", 2), Turn("three", 2)), system="sys"),
             Conversation("c1", (Turn("one", 2), Turn("FAIL503", 2), Turn("never sent", 2)))]
    target = _target(server)
    runner = Runner(target, TokenCounter(None), progress=False)
    run = await runner.run(trace_workload(convs), LoadPoint(concurrency=1))
    c0 = sorted((r for r in run.results if r.conversation == "c0"), key=lambda r: r.turn)
    assert [r.ok for r in c0] == [True, True, True]
    # usage prompt_tokens = words of every message ("sys", users, replies " t0 t1"): the history grows
    # by the previous user turn and the reply the server gave.
    assert [r.prompt_tokens for r in c0] == [2, 2 + 2 + 1, 2 + 2 + 1 + 2 + 1]
    s = summarize_run(run, SLO())
    assert s["requests"]["sent"] == 5 and s["requests"]["failed"] == 1 and s["requests"]["not_sent"] == 1


async def test_completions_api_and_poisson_arrivals(server):
    convs = [_one(f"r{i}", f"prompt number {i}", 2) for i in range(8)]
    point = LoadPoint(concurrency=0, rate=50.0, seed=1)
    run = await Runner(_target(server, "completions"), TokenCounter(None), progress=False).run(
        trace_workload(convs), point)
    assert len(run.results) == 8 and all(r.ok for r in run.results)
    starts = sorted(r.start for r in run.results)
    assert starts[-1] > 0.01  # spread out by the arrival process, not all at once


async def test_trace_arrivals_and_duration(server):
    convs = [Conversation(f"a{i}", (Turn("x", 1),), arrival_s=0.2 * i) for i in range(3)]
    run = await Runner(_target(server), TokenCounter(None), progress=False).run(
        trace_workload(convs), LoadPoint(concurrency=0, rate=TRACE_RATE))
    starts = sorted(r.start for r in run.results)
    assert starts[1] - starts[0] >= 0.15 and starts[2] - starts[0] >= 0.35
    endless = trace_workload([_one(f"d{i}", "x", 1) for i in range(10_000)])
    t0 = asyncio.get_running_loop().time()
    run = await Runner(_target(server), TokenCounter(None), progress=False).run(
        endless, LoadPoint(concurrency=2, duration_s=0.5))
    assert asyncio.get_running_loop().time() - t0 < 5
    assert 0 < len(run.results) < 10_000 and all(r.ok for r in run.results)


async def test_warmup_is_not_reported_and_window_edges_are_called(server):
    edges: list[str] = []
    warm = trace_workload([_one(f"w{i}", "warm", 1) for i in range(3)])
    run = await Runner(_target(server), TokenCounter(None), progress=False).run(
        trace_workload([_one("m", "measured")]), LoadPoint(concurrency=1, warmup=3), warm, edges.append)
    assert [r.conversation for r in run.results] == ["m"]
    assert edges == ["start", "end"]


async def test_client_token_counts_follow_the_history(server):
    from benchmarks.serve.tokens import load_tokenizer

    counter = TokenCounter(load_tokenizer("embedded"))
    conv = Conversation("c", (Turn("one two three", 3), Turn("four five", 3), Turn("FAIL503", 3)), system="sys")
    run = await Runner(_target(server), counter, progress=False).run(trace_workload([conv]), LoadPoint(1))
    r0, r1, r2 = sorted(run.results, key=lambda r: r.turn)
    assert r0.client_prompt_tokens == counter.chat(conv.messages(0, []))
    assert r1.client_prompt_tokens == counter.chat(conv.messages(1, [r0.text]))
    assert r2.client_prompt_tokens == counter.chat(conv.messages(2, [r0.text, r1.text])) > r1.client_prompt_tokens
    assert r1.client_completion_tokens == counter.output(r1.text) and r2.client_completion_tokens is None
