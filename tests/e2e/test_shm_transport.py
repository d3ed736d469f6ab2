"""The shm transport: prefill writes pages straight into a same-host decode's shared-memory pool (named by
decode's typed ShmPool destination); the PushKV stream carries descriptors only. Same tokens as the
engine; the pool's file goes with decode."""

from __future__ import annotations

import asyncio
import glob

import pytest

from benchmarks.served_cost import engine_core_pid
from services.launcher import LocalCluster
from tests.e2e.cluster_util import CHAT_PROMPTS, metric_sum, wait_idle
from tests.e2e.test_pd_cluster import LONG, _chat_ids, _reference, _router_generate

pytestmark = pytest.mark.e2e


def test_shm_transport_gives_engine_tokens_and_cleans_up(reference_engine):
    extra = {"prefill": ["--max-prefill-chunk", "29", "--kv-cache-bytes", str(96 << 20)],
             "decode": ["--kv-cache-bytes", str(96 << 20)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, dtype="float32", extra=extra, quiet=True,
                      kv_transport="shm") as c:
        front = c.get("decode-0").ready["pid"]
        pid = engine_core_pid(front) or front  # the pool is the engine core's (the front's without one)
        assert glob.glob(f"/dev/shm/pdserve-kv-{pid}-*")
        for text in [*CHAT_PROMPTS, LONG]:
            ids = _chat_ids(reference_engine, text)
            got = asyncio.run(_router_generate(c.router["grpc"], ids))
            assert list(got.token_ids) == _reference(reference_engine, ids)
        pm, dm = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport="shm") > 0
        assert metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport="grpc") == 0
        assert metric_sum(pm, "pdserve_prefill_kv_transport_fallbacks_total") == 0
        assert metric_sum(dm, "pdserve_decode_kv_received_bytes_total", transport="shm") == \
            metric_sum(pm, "pdserve_prefill_kv_sent_bytes_total", transport="shm")
        rep = wait_idle(c.get("decode-0").ready["grpc"])
        assert rep.free_blocks == rep.total_blocks
    assert not glob.glob(f"/dev/shm/pdserve-kv-{pid}-*")
