"""Rank-to-rank pages over Mooncake (loopback TCP, real processes, gloo): every decode rank registers its KV
shard with its own transfer engine and Reserve offers them as one ShardedPool of MooncakePools; every prefill
rank writes its heads into the decode ranks that hold them through its own engine (parallel/mooncake_ranks.py).
Greedy tokens equal the colocated TP=1 engine's; no page byte goes in the stream; every prefill rank wrote."""

from __future__ import annotations

import asyncio

import pytest

from services.common.metrics import (
    DECODE_KV_RECEIVED_BYTES_TOTAL,
    PREFILL_KV_RANK_PAGES_TOTAL,
    PREFILL_KV_SENT_BYTES_TOTAL,
    PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL,
)
from services.engine.kv_transport import mooncake
from services.launcher import LocalCluster
from tests.e2e.cluster_util import metric_sum, wait_idle
from tests.e2e.test_handoff_errors import _abort
from tests.e2e.test_tensor_parallel_pd import ENGINE, MODEL, PROMPTS, _generate, _reference_tokens
from tests.e2e.test_tp_rank_pages import _reserve

NO_MOONCAKE = mooncake.available()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(NO_MOONCAKE is not None,
                                                  reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _reference_tokens(PROMPTS)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), pytest.param(2, 1, marks=pytest.mark.slow),
                                                       pytest.param(1, 2, marks=pytest.mark.slow)])
def test_tp_over_mooncake_equals_colocated_tp1(prefill_tp: int, decode_tp: int, reference) -> None:
    extra = {"prefill": [*ENGINE, "--max-prefill-chunk", "32", "--tensor-parallel-size", str(prefill_tp)],
             "decode": [*ENGINE, "--tensor-parallel-size", str(decode_tp)]}
    with LocalCluster(prefill=1, decode=1, kvstore=None, model=MODEL, dtype="float32", extra=extra,
                      quiet=True, kv_transport="mooncake") as c:
        addr = c.get("decode-0").ready["grpc"]
        resv = asyncio.run(_reserve(addr, PROMPTS[1]))
        assert asyncio.run(_abort(addr, resv.reservation_id))
        dest = resv.destination
        if decode_tp > 1:
            ranks = dest.sharded.ranks
            assert dest.WhichOneof("pool") == "sharded" and len(ranks) == decode_tp
            assert {r.pool.WhichOneof("pool") for r in ranks} == {"mooncake"}
            assert len({r.pool.mooncake.segment for r in ranks}) == decode_tp  # each rank's own engine
        else:
            assert dest.WhichOneof("pool") == "mooncake"
        for ids, want in zip(PROMPTS, reference, strict=True):
            assert asyncio.run(_generate(c.router["grpc"], ids)) == want, (prefill_tp, decode_tp)
        prefill, decode = c.get("prefill-0").ready["metrics"], c.get("decode-0").ready["metrics"]
        assert metric_sum(prefill, PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL) == 0
        assert metric_sum(decode, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="mooncake") > 0
        assert metric_sum(decode, DECODE_KV_RECEIVED_BYTES_TOTAL, transport="grpc") == 0
        assert metric_sum(prefill, PREFILL_KV_SENT_BYTES_TOTAL, transport="grpc") == 0
        by_rank = [metric_sum(prefill, PREFILL_KV_RANK_PAGES_TOTAL, rank=str(r)) for r in range(prefill_tp)]
        assert all(by_rank), by_rank
        pages = sum(-(-len(p) // 16) for p in PROMPTS)  # block size 16
        assert sum(by_rank) == 2 * pages, by_rank  # 2 KV heads: 2 (prefill head group, decode rank) pairs
        rep = wait_idle(addr)
        assert rep.free_blocks == rep.total_blocks
