"""``pdserve bench kv``'s CPU-bound limit: the most GB/s two processes' measured CPU cost allows."""

from __future__ import annotations

import math

from benchmarks.kv_bench import cpu_bound_gbps


def test_the_limit_is_the_cores_over_both_sides_cost() -> None:
    assert math.isclose(cpu_bound_gbps(0.66, 0.69, 2), 2 / 1.35)
    assert math.isclose(cpu_bound_gbps(0.2, 0.2, 1), 2.5)
    assert cpu_bound_gbps(0.5, 0.5, 4) == 2 * cpu_bound_gbps(0.5, 0.5, 2)


def test_a_path_that_cost_no_measurable_cpu_has_no_limit() -> None:
    assert cpu_bound_gbps(0.0, 0.0, 2) == math.inf
