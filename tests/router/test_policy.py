"""Instance selection policies and discovery (no servers needed: channels connect lazily)."""

from __future__ import annotations

import pytest

from services.common.pb import common_pb2
from services.engine.block_hash import block_hashes
from services.router.instances import InstancePool, _resolve
from services.router.policy import NoInstanceError, choose


@pytest.fixture
async def pool():
    p = InstancePool("decode", ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])
    await p._refresh_targets()
    yield p
    await p.close()


async def test_round_robin_cycles_over_healthy(pool):
    picks = [choose(pool, "round_robin", []).address for _ in range(6)]
    assert sorted(set(picks)) == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    assert picks[:3] == picks[3:]
    pool.mark_failed(pool.instances["127.0.0.1:2"], "test")
    assert "127.0.0.1:2" not in {choose(pool, "round_robin", []).address for _ in range(6)}


async def test_least_loaded_uses_reports_and_inflight(pool):
    for addr, running in (("127.0.0.1:1", 5), ("127.0.0.1:2", 1), ("127.0.0.1:3", 3)):
        pool.instances[addr].load = common_pb2.LoadReport(running=running, total_blocks=100, free_blocks=50)
    assert choose(pool, "least_loaded", []).address == "127.0.0.1:2"
    pool.instances["127.0.0.1:2"].inflight = 4  # this router already sent it work the report lacks
    assert choose(pool, "least_loaded", []).address == "127.0.0.1:3"


async def test_prefix_aware_prefers_longest_block_run(pool):
    a = block_hashes(list(range(64)), 16)
    b = block_hashes(list(range(32)) + list(range(500, 532)), 16)
    pool.instances["127.0.0.1:3"].remember(a)
    pool.instances["127.0.0.1:1"].remember(b)
    assert choose(pool, "prefix_aware", a).address == "127.0.0.1:3"          # 4 blocks vs 2
    assert choose(pool, "prefix_aware", b).address == "127.0.0.1:1"          # 4 blocks vs 2
    other = block_hashes(list(range(900, 964)), 16)
    pool.instances["127.0.0.1:1"].load = common_pb2.LoadReport(running=9)
    pool.instances["127.0.0.1:3"].load = common_pb2.LoadReport(running=9)
    assert choose(pool, "prefix_aware", other).address == "127.0.0.1:2"      # no match: least loaded


async def test_no_healthy_instance_names_the_known_ones(pool):
    for inst in pool.instances.values():
        pool.mark_failed(inst, "test")
    with pytest.raises(NoInstanceError, match=r"127\.0\.0\.1:2 \(unhealthy\)"):
        choose(pool, "round_robin", [])


def test_dns_target_resolves_every_address():
    assert _resolve("dns:localhost:50061") == ["127.0.0.1:50061"] or "[::1]:50061" in _resolve("dns:localhost:50061")
    assert _resolve("10.0.0.5:7") == ["10.0.0.5:7"]  # static targets pass through (never dialled here)
