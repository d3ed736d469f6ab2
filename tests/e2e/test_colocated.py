"""Colocated mode (one worker does prefill and decode) through the router: the A/B baseline gives the
engine's tokens."""

from __future__ import annotations

import asyncio

import pytest

from services.launcher import LocalCluster
from tests.e2e.cluster_util import CHAT_PROMPTS, wait_idle
from tests.e2e.test_pd_cluster import _chat_ids, _reference, _router_generate

pytestmark = pytest.mark.e2e


def test_colocated_worker_equals_engine(reference_engine):
    extra = {"decode": ["--kv-cache-bytes", str(96 << 20)]}
    with LocalCluster(prefill=0, decode=1, kvstore=None, dtype="float32", colocated=True, extra=extra,
                      quiet=True) as c:
        for text in CHAT_PROMPTS:
            ids = _chat_ids(reference_engine, text)
            got = asyncio.run(_router_generate(c.router["grpc"], ids))
            assert list(got.token_ids) == _reference(reference_engine, ids)
        rep = wait_idle(c.get("worker-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks
