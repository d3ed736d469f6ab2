"""A small bounded load on a busy host (the CPU hog of benchmarks/load_test.py running): 1P1D, 8
concurrent clients of the real ``openai`` client, 40 short streamed requests. Every request completes
or is refused with 429/503 and Retry-After; no 200 is empty; the router never reports a live instance
unhealthy. Designed to finish well under 90 s (cluster start included) on a 2-core machine."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.load_test import KINDS, Sampler, cpu_hog, make_prompts, run_level
from services.launcher import LocalCluster, served_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REQUESTS = 40
CONCURRENCY = 8


def test_small_load_on_a_busy_host() -> None:
    prompts = make_prompts(REQUESTS, 96)
    with cpu_hog(), LocalCluster(prefill=1, decode=1, kvstore=None, quiet=True) as cluster, \
            Sampler(cluster, interval_s=0.5) as sampler:
        http = cluster.router["http"]
        level = asyncio.run(run_level(http, served_model(http), prompts, "1p1d", CONCURRENCY, duration_s=60.0,
                                      max_tokens=8, request_timeout_s=60.0, drain_s=20.0,
                                      max_requests=REQUESTS))
        sampler.sample()
        assert not cluster.dead()
    counts = level.counts
    assert set(counts) == set(KINDS) and sum(counts.values()) == REQUESTS, counts
    assert counts["empty_200"] == 0, level.details
    assert counts["other"] == 0, level.details  # every failure is a 429/503 that carried Retry-After
    assert counts["completed"] >= 1, counts
    assert not sampler.unhealthy, sampler.unhealthy
    assert sampler.rss and all(samples for samples in sampler.rss.values())
