"""pdserve bench pd-vs-dp's rows, ratios and table, without servers."""

from __future__ import annotations

import math

from benchmarks.gpu_pd_vs_dp import DP, PD, Row, ratios, table
from benchmarks.serve.client import RequestResult
from benchmarks.serve.load import LoadPoint, RunResult
from benchmarks.serve.report import summarize_run
from benchmarks.serve.stats import SLO


def _row(setup: str, c: int, ttft: float, tpot: float, tok_s: float, failed: int = 0) -> Row:
    return Row(setup, c, ttft, ttft * 2, tpot, tok_s, tok_s / 100, 10, failed)


def test_ratio_is_1p1d_over_2xdp_per_concurrency_and_column() -> None:
    rows = [_row(PD, 8, 100.0, 20.0, 1000.0), _row(DP, 8, 50.0, 25.0, 800.0), _row(PD, 32, 10.0, 1.0, 10.0)]
    r = ratios(rows)
    assert set(r) == {8}  # concurrency 32 has no 2xDP row: no ratio
    assert r[8]["ttft_p50_ms"] == 2.0 and r[8]["ttft_p90_ms"] == 2.0
    assert r[8]["tpot_p50_ms"] == 0.8
    assert r[8]["output_tok_s"] == 1.25 and r[8]["requests_per_s"] == 1.25


def test_ratio_of_a_missing_figure_is_nan_not_an_error() -> None:
    rows = [_row(PD, 4, math.nan, 20.0, 1.0), _row(DP, 4, 50.0, 0.0, 1.0)]
    r = ratios(rows)[4]
    assert math.isnan(r["ttft_p50_ms"]) and math.isnan(r["tpot_p50_ms"])
    assert r["output_tok_s"] == 1.0


def test_table_lists_1p1d_then_2xdp_then_their_ratio_for_each_concurrency() -> None:
    rows = [_row(DP, 32, 50.0, 25.0, 800.0), _row(PD, 32, 100.0, 20.0, 1000.0, failed=1),
            _row(DP, 8, 5.0, 2.0, 80.0), _row(PD, 8, 4.0, math.nan, 40.0)]
    lines = table(rows).splitlines()
    assert lines[0].startswith("| set-up | conc | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | out tok/s | req/s |")
    body = [ln.split(" | ")[:2] for ln in lines[2:]]
    assert body == [["| 1P1D", "8"], ["| 2xDP", "8"], ["| 1P1D / 2xDP", "8"],
                    ["| 1P1D", "32"], ["| 2xDP", "32"], ["| 1P1D / 2xDP", "32"]]
    assert "| 1P1D / 2xDP | 8 | 0.80x | 0.80x | - | 0.50x | 0.50x | |" in lines
    assert "| 1P1D | 32 | 100.0 | 200.0 | 20.0 | 1000.0 | 10.0 | 10/1 |" in lines


def test_row_reads_the_serving_benchmarks_summary_in_ms() -> None:
    results = []
    for i, (ttft, e2e) in enumerate(((0.1, 1.1), (0.3, 2.3))):
        r = RequestResult(f"c{i}", 0, 0.0, ok=True, ttft=ttft, e2e=e2e, prompt_tokens=2048,
                          completion_tokens=11, event_times=[ttft, e2e])
        results.append(r)
    results.append(RequestResult("bad", 0, 0.0, error="timeout"))
    run = RunResult(LoadPoint(concurrency=2), results, 0, (0.0, 1.0), duration_s=2.0)
    row = Row.of(PD, 2, summarize_run(run, SLO()))
    assert (row.completed, row.failed) == (2, 1)
    assert math.isclose(row.ttft_p50_ms, 200.0) and math.isclose(row.ttft_p90_ms, 280.0)
    assert math.isclose(row.tpot_p50_ms, 150.0)  # TPOTs 100 and 200 ms: (e2e - ttft) / 10
    assert math.isclose(row.output_tok_s, 11.0) and math.isclose(row.requests_per_s, 1.0)


def test_row_of_a_run_where_nothing_completed_is_nan() -> None:
    run = RunResult(LoadPoint(concurrency=1), [RequestResult("x", 0, 0.0, error="http_503")], 0, (0.0, 1.0), 1.0)
    row = Row.of(DP, 1, summarize_run(run, SLO()))
    assert math.isnan(row.ttft_p50_ms) and row.output_tok_s == 0.0 and row.failed == 1


def test_two_gpu_placement_puts_prefill_and_decode_or_each_worker_on_its_own_gpu() -> None:
    from benchmarks.gpu_pd_vs_dp import placement_flags

    assert placement_flags(PD, "one-device") == {} == placement_flags(DP, "one-device")
    assert placement_flags(PD, "two-gpus") == {"prefill-0": ["--device", "cuda:0"], "decode-0": ["--device", "cuda:1"]}
    assert placement_flags(DP, "two-gpus") == {"worker-0": ["--device", "cuda:0"], "worker-1": ["--device", "cuda:1"]}
