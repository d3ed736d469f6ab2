"""pdserve bench cpu-serving: summaries, goal ratios and the llama.cpp request body, without servers."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from benchmarks.cpu_serving_bench import (
    LlamaTarget,
    Point,
    SystemResult,
    goal_lines,
    llama_python,
    parse_histogram_sums,
    ratios,
    stage_means,
    summarize,
    table,
)
from benchmarks.serve.client import RequestResult


def _req(ttft: float, e2e: float, tokens: int | None, events: int = 0, ok: bool = True) -> RequestResult:
    r = RequestResult("c", 0, 0.0, ok=ok, ttft=ttft, e2e=e2e, completion_tokens=tokens, prompt_tokens=512)
    r.event_times = [ttft + i * 0.01 for i in range(events)]
    return r


def test_summarize_takes_medians_and_counts_tokens_from_usage_or_events() -> None:
    rs = [_req(0.5, 1.5, 11), _req(0.7, 2.7, 11), _req(0.6, 0.6 + 0.1 * 10, None, events=11),
          _req(9.0, 9.0, 11, ok=False)]
    p = summarize(rs, 4, round_walls=[2.0, 4.0], round_tokens=[40, 40])
    assert p.ttft_s == pytest.approx(0.6)  # failed request left out
    assert p.tpot_s == pytest.approx(0.1)  # (1.0, 2.0, 1.0) / 10 -> median 0.1
    assert p.output_tok_s == pytest.approx(15.0)  # median of 20 and 10
    assert (p.requests, p.failed, p.prompt_tokens) == (4, 1, 512)


def test_summarize_without_successes_is_nan_not_an_error() -> None:
    p = summarize([_req(1.0, 2.0, 5, ok=False)], 1, [1.0], [0])
    assert math.isnan(p.ttft_s) and p.tpot_s is None and p.failed == 1


def _system(name: str, points: list[Point], skipped: str = "") -> SystemResult:
    return SystemResult(name, "cmd", points=points, skipped=skipped)


def test_ratios_against_the_engine_and_llamacpp() -> None:
    engine = _system("engine", [Point(0, 0.40, 0.02, 0.0, 0, 0, 512)])
    up = _system("up", [Point(1, 0.50, 0.010, 90.0, 3, 0, 512), Point(16, 2.0, 0.05, 300.0, 48, 0, 512)])
    llama = _system("llamacpp", [Point(1, 0.30, 0.0125, 75.0, 3, 0, 512), Point(16, 9.0, 0.0125, 100.0, 48, 0, 512)])
    r = ratios(engine, [up], llama, 16)
    assert r.ttft_over_prefill["up"] == pytest.approx(1.25)
    assert r.decode_vs_llamacpp["up"] == pytest.approx(1.25)  # 100 tok/s vs 80 tok/s
    assert r.throughput16_vs_llamacpp["up"] == pytest.approx(3.0)
    lines = goal_lines(r, 16)
    assert lines[0].endswith("MET") and "1.25x" in lines[0]
    assert all(line.endswith("MET") for line in lines)
    worse = ratios(_system("engine", [Point(0, 0.2, 0.02, 0.0, 0, 0, 512)]), [up], llama, 16)
    assert goal_lines(worse, 16)[0].endswith("MISSED")  # 2.5x > 1.3


def test_a_skipped_llamacpp_leaves_its_ratios_out_and_says_why() -> None:
    up = _system("up", [Point(1, 0.5, 0.01, 90.0, 3, 0, 512)])
    skipped = _system("llamacpp", [], skipped="llama-cpp-python[server] is not installed")
    r = ratios(None, [up], skipped, 16)
    assert not r.ttft_over_prefill and not r.decode_vs_llamacpp and not r.throughput16_vs_llamacpp
    assert "skipped: llama-cpp-python[server] is not installed" in table([up, skipped], [1])


def test_llama_body_bans_end_tokens_instead_of_ignore_eos() -> None:
    body = LlamaTarget("http://127.0.0.1:1", "m", api="completions", banned_token_ids=(2, 0)).body("hi", 8)
    assert "ignore_eos" not in body and body["logit_bias"] == {"2": -100.0, "0": -100.0}
    assert body["prompt"] == "hi" and body["max_tokens"] == 8 and body["stream"] is True


def test_llama_python_reports_a_missing_package() -> None:
    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed in this environment: nothing missing to report")
    exe, why = llama_python(sys.executable)
    assert exe is None and "llama-cpp-python[server] is not installed" in why


def test_stage_means_from_two_scrapes() -> None:
    text0 = ("# HELP pdserve_prefill_compute_seconds x\n"
             'pdserve_prefill_compute_seconds_bucket{le="0.5"} 1\n'
             "pdserve_prefill_compute_seconds_sum 0.4\npdserve_prefill_compute_seconds_count 1\n"
             'pdserve_router_time_to_first_token_seconds_sum{model="m"} 1.0\n'
             'pdserve_router_time_to_first_token_seconds_count{model="m"} 2\n')
    text1 = text0.replace("compute_seconds_sum 0.4", "compute_seconds_sum 1.6").replace(
        "compute_seconds_count 1", "compute_seconds_count 4")
    before, after = parse_histogram_sums(text0), parse_histogram_sums(text1)
    assert before["pdserve_prefill_compute_seconds"] == (0.4, 1.0)
    means = stage_means(before, after)
    assert means == {"pdserve_prefill_compute_seconds": pytest.approx(0.4)}  # router unchanged: left out
