"""Instance selection policies and discovery (no servers needed: channels connect lazily)."""

from __future__ import annotations

import pytest

from services.common.block_hash import block_hashes
from services.common.pb import common_pb2
from services.router.instances import Instance, InstancePool, Liveness, _resolve
from services.router.policy import NoInstanceError, choose

ADDRS = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]


@pytest.fixture
async def pool():
    p = InstancePool("decode", ADDRS)
    await p._refresh_targets()
    for inst in p.instances.values():
        inst.state = Liveness.HEALTHY
    yield p
    await p.close()


async def test_round_robin_cycles_over_healthy(pool):
    picks = [choose(pool, "round_robin", []).address for _ in range(6)]
    assert sorted(set(picks)) == ADDRS
    assert picks[:3] == picks[3:]
    pool.report_gone(pool.instances["127.0.0.1:2"], "test")
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


async def test_prefix_aware_gives_way_to_load(pool):
    a = block_hashes(list(range(64)), 16)
    holder = pool.instances["127.0.0.1:3"]
    holder.remember(a)
    holder.inflight = 1
    assert choose(pool, "prefix_aware", a) is holder  # a whole-prompt match is worth 2 queued requests
    holder.inflight = 3
    assert choose(pool, "prefix_aware", a) is not holder


async def test_shared_system_prompt_spreads_over_two_decodes():
    """24 requests sharing a 448-token system prompt with distinct 16-token tails, arriving while
    earlier ones still run (each runs for 4 arrivals): neither decode gets less than 25%."""
    p = InstancePool("decode", ADDRS[:2])
    await p._refresh_targets()
    for inst in p.instances.values():
        inst.state = Liveness.HEALTHY
    system = list(range(1000, 1448))
    running: list[tuple[int, Instance]] = []
    counts = dict.fromkeys(ADDRS[:2], 0)
    for n in range(24):
        for done in [r for r in running if r[0] <= n]:
            done[1].inflight -= 1
            running.remove(done)
        hashes = block_hashes(system + list(range(n * 16, n * 16 + 16)), 16)
        inst = choose(p, "prefix_aware", hashes)
        inst.remember(hashes)
        inst.inflight += 1
        running.append((n + 4, inst))
        counts[inst.address] += 1
    await p.close()
    assert min(counts.values()) >= 6, counts


async def test_overloaded_and_suspect_instances_are_used_only_when_nothing_else_is(pool):
    one, two, three = (pool.instances[a] for a in ADDRS)
    one.load = common_pb2.LoadReport(saturated=True)
    pool.report_overloaded(two, retry_after_s=60)
    assert {choose(pool, "round_robin", []).address for _ in range(6)} == {three.address}
    three.state = Liveness.SUSPECT
    assert {choose(pool, "round_robin", []).address for _ in range(6)} == set(ADDRS)  # all alive, none better
    pool.report_gone(three, "draining")
    assert {choose(pool, "least_loaded", []).address for _ in range(6)} <= {one.address, two.address}


async def test_no_instance_left_names_the_known_ones(pool):
    for inst in pool.instances.values():
        pool.report_gone(inst, "test")
    with pytest.raises(NoInstanceError, match=r"127\.0\.0\.1:2 \(dead: test\)"):
        choose(pool, "round_robin", [])
    pool.instances["127.0.0.1:2"].state = Liveness.HEALTHY
    with pytest.raises(NoInstanceError, match=r"already tried"):
        choose(pool, "round_robin", [], {"127.0.0.1:2"})


def test_dns_target_resolves_every_address():
    assert _resolve("dns:localhost:50061") == ["127.0.0.1:50061"] or "[::1]:50061" in _resolve("dns:localhost:50061")
    assert _resolve("10.0.0.5:7") == ["10.0.0.5:7"]  # static targets pass through (never dialled here)
