"""DeepSeek-V3.2's index keys rank to rank over Mooncake (parallel/mooncake_ranks.py, rank_regions.py) in one process
over loopback TCP: every decode rank registers its latent shard and its index-key pool with its own transfer engine
and offers both; every prefill rank opens every decode rank's index-key pool, and its share of a chunk lands
byte-identical in all of them beside the latent, at the same block ids, for native and fp8-e4m3 index keys; a
region whose codec differs is refused before anything is written, naming both regions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.common.pb import decode_pb2
from services.engine.index_keys import IndexKeys
from services.engine.kv_layout import FP8_CODEC
from services.engine.kv_transport import mooncake
from services.engine.parallel.mooncake_ranks import RankMooncake, RemoteRegion
from services.engine.parallel.rank_pages import RankPools, ShardWrites, sharded_destination
from services.engine.parallel.rank_regions import check_regions, offers
from services.engine.parallel.rank_writes import write_share
from services.engine.parallel.split import HeadSplit
from services.engine.region_pools import region_name
from services.engine.shared_kv import SharedKVAttachError
from tests.engine.test_rank_pages import _index as index_pool

NO_MOONCAKE = mooncake.available()
pytestmark = pytest.mark.skipif(NO_MOONCAKE is not None, reason=f"the Mooncake wheel cannot load here: {NO_MOONCAKE}")

L, BS, D, BLOCKS, INDEX_DIM = 2, 4, 8, 12, 8
HOST = "127.0.0.1"
NATIVE = "fp32"  # the pool dtype's codec (--index-kv-codec native)
KEEP: list[torch.Tensor] = []
"""Every registered tensor stays alive for the module (an engine keeps memory registered; a freed tensor's address
reused by the next one would overlap a registration, as a real pool never does)."""


def _engines(n: int, count: int = 1) -> list[RankMooncake]:
    out = [RankMooncake() for _ in range(n)]
    for e in out:
        e.start(HOST, count)
    return out


@pytest.fixture(scope="module")
def decode_ranks() -> list[RankMooncake]:
    return _engines(2, count=2)  # two engines a rank: a region pool must sit on both of its shard's segments


@pytest.fixture(scope="module")
def prefill_ranks() -> list[RankMooncake]:
    return _engines(2)


def _keep(t: torch.Tensor) -> torch.Tensor:
    KEEP.append(t)
    return t


def _index(codec: str, seed: int | None = None) -> IndexKeys:
    """An index-key pool of BLOCKS blocks (``seed``: filled with keys, else zero), kept alive while registered."""
    keys = index_pool(codec, seed)
    _keep(keys.kv_cache)
    return keys


def _latent(seed: int | None = None) -> torch.Tensor:
    """A latent cache [L, 2, blocks, bs, 1, D] (one KV head, on every rank): ``seed``: random, else zero."""
    shape = (L, 2, BLOCKS, BS, 1, D)
    return _keep(torch.zeros(shape) if seed is None else torch.randn(shape, generator=torch.Generator().manual_seed(
        seed)))


def _decode(ranks: list[RankMooncake], codec: str) -> tuple[decode_pb2.KVDestination, list[torch.Tensor],
                                                             list[IndexKeys]]:
    """A latent-attention decode at TP=len(ranks), each rank offering its shard and its index-key pool of ``codec``
    over its own engines: (destination, latent pools, index keys)."""
    latent, index, dests = [], [], []
    for rank in ranks:
        t, keys = _latent(), _index(codec)
        dest = rank.offer(t, HOST, 2, [(keys.region(), keys.kv_cache)])
        assert dest is not None
        dests.append(dest)
        latent.append(t)
        index.append(keys)
    dest = dests[0] if len(ranks) == 1 else sharded_destination(HeadSplit(4, 1, len(ranks), 0), dests)
    return dest, latent, index


@pytest.mark.parametrize("codec", [NATIVE, FP8_CODEC])
@pytest.mark.parametrize(("a", "b"), [(2, 2), (2, 1), (1, 2)])
def test_index_keys_land_in_every_decode_rank(decode_ranks, prefill_ranks, codec: str, a: int, b: int) -> None:
    """Prefill at TP=a, decode at TP=b: the prefill ranks split each chunk's pages and each writes its share of the
    index keys into every decode rank's pool over Mooncake, with its latent; every decode rank then holds the
    prefill's latent and index-key bytes at the destination blocks and nothing elsewhere."""
    dest, dec_latent, dec_index = _decode(decode_ranks[:b], codec)
    offered = dest.sharded.ranks[0].pool if b > 1 else dest
    assert offered.index.WhichOneof("pool") == "mooncake" and offered.index.region == region_name(
        _index(codec).region())
    assert mooncake.segments_of(offered.index.mooncake) == mooncake.segments_of(offered.mooncake)  # same engines
    latent, keys = _latent(seed=3), _index(codec, seed=4)  # every prefill rank holds the same latent and keys
    assert offers(dest, [(keys.region(), keys.kv_cache)])
    raw = dest.SerializeToString(deterministic=True)
    src_blocks, dst_blocks = [1, 2, 3, 7, 8], [9, 10, 0, 4, 5]
    for r in range(a):
        split = HeadSplit(4, 1, a, r)
        pools = RankPools(latent, split)
        pools.mooncake = prefill_ranks[r]
        shards, regions = pools.shards(raw, [(keys.region(), keys.kv_cache)])
        assert [type(x.pool) for x in regions] == [RemoteRegion] * b  # every decode rank's index-key pool
        write_share(latent, split, shards, src_blocks, dst_blocks, regions)
    others = [x for x in range(BLOCKS) if x not in dst_blocks]
    for t, i in zip(dec_latent, dec_index, strict=True):
        assert torch.equal(t[:, :, dst_blocks], latent[:, :, src_blocks]) and not t[:, :, others].any()
        assert torch.equal(i.kv_cache[:, :, dst_blocks], keys.kv_cache[:, :, src_blocks])
        assert i.kv_cache[:, :, dst_blocks].any() and not i.kv_cache[:, :, others].any()


class _Runner:
    """What ShardWrites reads of a TP=1 prefill's runner: its cache, split and region pools (index keys)."""

    def __init__(self, cache: torch.Tensor, index_keys: IndexKeys) -> None:
        self.kv_cache, self.model, self.index_keys, self.spec = cache, SimpleNamespace(tp_split=HeadSplit(4, 1, 1, 0)
                                                                                       ), index_keys, None


def test_a_tp1_prefill_writes_both_regions_through_shard_writes(decode_ranks) -> None:
    """Rank 0 of a TP=1 prefill: attach starts its engine and opens both decode ranks' latent and index-key pools, the
    chunk's start submits both regions' batches, finish settles them; a block outside the pools fails the write."""
    dest, dec_latent, dec_index = _decode(decode_ranks, FP8_CODEC)
    runner = _Runner(_latent(seed=5), _index(FP8_CODEC, seed=6))
    writes = ShardWrites(runner)
    attached = writes.attach(dest, (HOST, 1))
    assert attached.blocks == BLOCKS and [type(r.pool) for r in attached.regions] == [RemoteRegion] * 2
    w = writes.start(attached, [0, 5, 6], [6, 11, 2])
    assert w.error is None and w.own is not None and w.own.batches  # submitted, not waited for
    writes.finish(w)
    for t, i in zip(dec_latent, dec_index, strict=True):
        assert torch.equal(t[:, :, [6, 11, 2]], runner.kv_cache[:, :, [0, 5, 6]])
        assert torch.equal(i.kv_cache[:, :, [6, 11, 2]], runner.index_keys.kv_cache[:, :, [0, 5, 6]])
    with pytest.raises(ValueError, match="destination block 12"):
        attached.regions[0].pool.write([0], [BLOCKS])


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_an_index_codec_that_differs_is_refused_naming_both(decode_ranks, prefill_ranks, decode_tp: int) -> None:
    """Prefill fp8-e4m3 index keys against decode's native ones over Mooncake: refused (reason index) naming both
    regions, by rank 0 before any rank opens a pool and by a rank's own open; nothing is written."""
    dest, dec_latent, dec_index = _decode(decode_ranks[:decode_tp], NATIVE)
    keys = _index(FP8_CODEC, seed=7)
    own = [(keys.region(), keys.kv_cache)]
    theirs = region_name(_index(NATIVE).region())
    with pytest.raises(SharedKVAttachError) as e:
        ShardWrites(_Runner(_latent(seed=8), keys)).attach(dest, (HOST, 1))
    assert e.value.reason == "index" and region_name(keys.region()) in str(e.value) and theirs in str(e.value)
    pools = RankPools(_latent(seed=8), HeadSplit(4, 1, 1, 0))
    pools.mooncake = prefill_ranks[0]
    with pytest.raises(SharedKVAttachError) as e:
        pools.shards(dest.SerializeToString(deterministic=True), own)
    assert e.value.reason == "index" and region_name(keys.region()) in str(e.value) and theirs in str(e.value)
    assert not any(t.any() for t in dec_latent) and not any(i.kv_cache.any() for i in dec_index)


def test_a_region_on_other_engines_or_beside_a_landing_area_is_refused(decode_ranks, prefill_ranks) -> None:
    """An index-key pool that is not on its shard's transfer engines is refused (reason index); a landing area (a
    device pool's, every region in its slots) is not written rank to rank (reason device)."""
    dest, _, _ = _decode(decode_ranks[:1], NATIVE)
    keys = _index(NATIVE, seed=9)
    own = [(keys.region(), keys.kv_cache)]
    moved = decode_pb2.KVDestination()
    moved.CopyFrom(dest)
    moved.index.mooncake.segment = decode_ranks[1].engine.segment
    pools = RankPools(_latent(seed=10), HeadSplit(4, 1, 1, 0))
    pools.mooncake = prefill_ranks[0]
    with pytest.raises(SharedKVAttachError, match="not registered with its KV pool's transfer engines") as e:
        pools.shards(moved.SerializeToString(deterministic=True), own)
    assert e.value.reason == "index"
    landing = decode_pb2.KVDestination()
    landing.CopyFrom(dest)
    landing.mooncake.page_major = True
    with pytest.raises(SharedKVAttachError, match="landing area") as e:
        check_regions(landing, own)
    assert e.value.reason == "device"
