"""pdserve bench cpu-serving: systems take turns round by round, and `up`'s TTFT is also compared with the
in-process prefill at the thread share its prefill engine gets."""

from __future__ import annotations

import pytest

from benchmarks.cpu_serving_bench import Point, SystemResult, goal_lines, ratios, turn_order


def test_turn_order_rotates_so_no_system_always_follows_the_same_one() -> None:
    names = ["engine", "up", "colocated", "llamacpp"]
    orders = [turn_order(names, i) for i in range(4)]
    assert orders[0] == names and orders[1] == ["up", "colocated", "llamacpp", "engine"]
    assert all(sorted(o) == sorted(names) for o in orders)  # every system once per round
    firsts = {o[0] for o in orders}
    assert firsts == set(names)  # each system leads one round in four
    assert turn_order([], 3) == []


def test_up_ttft_is_reported_against_both_prefill_references() -> None:
    engine = SystemResult("engine", "cmd", points=[Point(0, 0.20, 0.01, 0.0, 0, 0, 512)],
                          prefill_by_threads={2: 0.20, 1: 0.36})
    up = SystemResult("up", "cmd", points=[Point(1, 0.40, 0.012, 80.0, 3, 0, 512)])
    colocated = SystemResult("colocated", "cmd", points=[Point(1, 0.24, 0.012, 80.0, 3, 0, 512)])
    r = ratios(engine, [up, colocated], None, 16, share=1)
    assert r.ttft_over_prefill == {"up": pytest.approx(2.0), "colocated": pytest.approx(1.2)}
    assert r.ttft_over_share_prefill == {"up": pytest.approx(0.4 / 0.36)}  # colocated has all cores: no share line
    lines = goal_lines(r, 16)
    assert lines[0].endswith("MISSED")  # the goal stays judged against all cores
    assert "1 thread(s)" in lines[2] and "not the issue's goal" in lines[2]
