"""``pdserve bench serve --base-url`` end to end against the scripted server (in a thread): the
command's exit status, the printed table, and the report files (JSON, markdown, PNG plots)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from aiohttp import web

from services.cli import main
from tests.benchmarks.fake_openai import app


@pytest.fixture(scope="module")
def base_url():
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def start() -> None:
        runner = web.AppRunner(app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{holder['port']}"
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_serve_sweep_writes_a_report(base_url, tmp_path, capsys):
    out = tmp_path / "rep"
    trace = tmp_path / "saved.jsonl"
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", "none", "--concurrency", "1,2,4",
               "--requests", "6", "--input-tokens", "20", "--output-tokens", "4", "--warmup", "1",
               "--no-progress", "--num-gpus", "2", "--slo-ttft-ms", "5000", "--out", str(out),
               "--save-trace", str(trace), "--note", "test host"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "concurrency 4" in table and table.count("\n") >= 5
    rep = json.loads((out / "report.json").read_text())
    points = rep["servers"][0]["points"]
    assert [p["point"]["concurrency"] for p in points] == [1, 2, 4]
    assert all(p["requests"]["completed"] == 6 and p["tokens"]["output"] == 24 for p in points)
    assert "output_tok_s_per_gpu" in points[0]["throughput"]
    assert rep["command"].startswith("pdserve bench serve --base-url")
    md = (out / "report.md").read_text()
    assert "test host" in md and "![vs_load](vs_load.png)" in md and "![latency_cdf]" in md
    for png in ("vs_load.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(trace.read_text().splitlines()) == 6


def test_multi_turn_over_completions(base_url, capsys):
    rc = main(["bench", "serve", "--base-url", base_url + "/v1", "--tokenizer", "none", "--api", "completions",
               "--workload", "multi_turn", "--turns", "3", "--requests", "6", "--shared-prefix-tokens", "8",
               "--input-tokens", "10", "--output-tokens", "2", "--warmup", "0", "--no-progress"])
    assert rc == 0
    assert "| 6 | 6 |" in capsys.readouterr().out


def test_accuracy_with_a_reference(base_url, capsys, tmp_path):
    q = tmp_path / "q.jsonl"
    q.write_text('{"question": "Say t0", "answer": "t0", "grade": "text", "max_tokens": 2}\n'
                 '{"question": "What is 1 + 1?", "answer": 2, "grade": "number", "max_tokens": 2}\n')
    rc = main(["bench", "serve", "--base-url", base_url, "--tokenizer", "none", "--workload", "accuracy",
               "--trace", str(q), "--reference-url", base_url, "--no-progress", "--warmup", "0",
               "--concurrency", "2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "1/2 correct" in out and "2/2 outputs identical" in out


def test_bad_arguments_exit_2(base_url, capsys):
    assert main(["bench", "serve", "--tokenizer", "none"]) == 2
    assert "--recipe" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", base_url, "--workload", "trace"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", base_url, "--rate", "fast"]) == 2
    assert "--rate" in capsys.readouterr().err
