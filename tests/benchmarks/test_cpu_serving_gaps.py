"""pdserve bench cpu-serving: the first inter-token gap (P/D hand-off) is reported apart from the decode gaps."""

from __future__ import annotations

import pytest

from benchmarks.cpu_serving_bench import gap_split
from benchmarks.serve.client import RequestResult


def _req(times: list[float], ok: bool = True) -> RequestResult:
    return RequestResult("c", 0, 0.0, ok=ok, event_times=times)


def test_first_gap_is_split_from_the_later_gaps() -> None:
    # a 40 ms hand-off, then 18-20 ms steps; a second request with a 30 ms hand-off
    a = _req([0.100, 0.140, 0.158, 0.176, 0.196])
    b = _req([0.200, 0.230, 0.249, 0.268])
    first, later = gap_split([a, b])
    assert first == pytest.approx(0.035)  # median of 40 and 30 ms
    assert later == pytest.approx(0.019)  # median of 18, 20, 19, 19 ms: the hand-offs are not in it


def test_failed_and_single_token_requests_are_left_out() -> None:
    failed = _req([0.0, 1.0, 2.0], ok=False)
    single = _req([0.5])
    assert gap_split([failed, single]) == (None, None)
    first, later = gap_split([failed, _req([0.0, 0.05])])
    assert first == pytest.approx(0.05) and later is None  # two tokens: one gap, no later ones
