"""Rank-to-rank page writes (services/engine/parallel/rank_pages.py) without processes: every prefill rank's
share, for every (prefill TP, decode TP) over 2 and 4 KV heads, puts exactly each decode rank's heads into its
pool; DeepSeek-V3.2's replicated index-key region (rank_regions.py) lands whole in every decode rank's pool of it
at the target's block ids, its codec and its presence checked at attach; the offer's checks; the claim's
head-split checks (services/kv/claim.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.common.kv_kinds import pool_id
from services.common.pb import common_pb2, decode_pb2
from services.engine.index_keys import IndexKeys
from services.engine.kv_layout import FP8_CODEC, HeadSplitSpec, PageLayout, Region
from services.engine.kv_transport.base import TransferError
from services.engine.kv_transport.shared_pool import copy_pages_peer
from services.engine.parallel import rank_pages
from services.engine.parallel.rank_pages import (
    RankPools,
    ShardWrites,
    head_ranges,
    open_shards,
    pool_split,
    sharded_destination,
    spec_of,
)
from services.engine.parallel.rank_regions import offers, refused, share, shm_files
from services.engine.parallel.rank_writes import Shard, copy_heads, write_share
from services.engine.parallel.split import HeadSplit
from services.engine.region_pools import region_name, with_region_pool
from services.engine.shared_kv import SharedKVAttachError, create_shared_kv, open_shm_pool
from services.kv.claim import check_claim

L, BS, D, BLOCKS = 2, 4, 8, 12


def _full(kvh: int) -> torch.Tensor:
    """A TP=1 cache [L, 2, blocks, bs, kvh, D] with distinct values everywhere."""
    return torch.arange(L * 2 * BLOCKS * BS * kvh * D, dtype=torch.float32).view(L, 2, BLOCKS, BS, kvh, D)


@pytest.mark.parametrize("kvh", [2, 4])
@pytest.mark.parametrize(("a", "b"), [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (2, 4), (4, 4), (1, 4), (4, 1)])
def test_every_decode_rank_gets_exactly_its_heads(kvh: int, a: int, b: int) -> None:
    full = _full(kvh)
    src_blocks, dst_blocks = [1, 2, 3, 7, 8], [9, 10, 0, 4, 5]
    shards = [Shard((s, e), torch.zeros(L, 2, BLOCKS, BS, e - s, D)) for s, e in head_ranges(b, kvh)]
    written = []
    for r in range(a):  # each prefill rank holds only its heads of the same pages
        split = HeadSplit(4 * a, kvh, a, r)
        s, e = split.kv_range
        written.append(write_share(full[:, :, :, :, s:e].contiguous(), split, shards, src_blocks, dst_blocks))
    for sh in shards:
        s, e = sh.heads
        want = full[:, :, src_blocks, :, s:e]
        assert torch.equal(sh.pool[:, :, dst_blocks], want)
        others = [x for x in range(BLOCKS) if x not in dst_blocks]
        assert not sh.pool[:, :, others].any()  # nothing outside the destination blocks
    # Each page is written once per (prefill head group, decode rank) pair that share a head: prefill-side
    # replicas split the pages instead of writing them twice, and every prefill rank takes part.
    pairs = sum(max(p0, q0) < min(p1, q1) for p0, p1 in set(head_ranges(a, kvh)) for q0, q1 in head_ranges(b, kvh))
    assert sum(written) == len(src_blocks) * pairs
    assert all(written)


def test_gathered_copy_equals_the_run_copies() -> None:
    """The GPU form of copy_heads (gather, one copy, scatter) writes what the CPU's per-run copies write."""
    full = _full(4)
    src_blocks, dst_blocks = [1, 2, 3, 7, 8, 0], [9, 10, 0, 4, 5, 11]
    runs, gathered = torch.zeros(L, 2, BLOCKS, BS, 2, D), torch.zeros(L, 2, BLOCKS, BS, 2, D)
    copy_heads(full, src_blocks, (1, 3), runs, dst_blocks, (0, 2))
    copy_pages_peer(full, src_blocks, gathered, dst_blocks, (1, 3), (0, 2))
    assert torch.equal(runs, gathered) and torch.equal(runs[:, :, dst_blocks], full[:, :, src_blocks, :, 1:3])
    half = torch.zeros(L, 2, BLOCKS, BS, 2, D)  # into one head of a two-head pool
    copy_pages_peer(full, src_blocks, half, dst_blocks, (3, 4), (1, 2))
    assert torch.equal(half[:, :, dst_blocks, :, 1:2], full[:, :, src_blocks, :, 3:4]) and not half[..., 0, :].any()
    whole = torch.zeros(L, 2, BLOCKS, BS, 4, D)  # all heads (the cuda-ipc writer's form)
    copy_pages_peer(full, src_blocks, whole, dst_blocks)
    assert torch.equal(whole[:, :, dst_blocks], full[:, :, src_blocks])
    with pytest.raises(ValueError, match="destination block 99"):
        copy_pages_peer(full, src_blocks[:1], whole, [99])


def test_open_shards_checks_the_split_and_the_pool_shapes() -> None:
    cache = torch.zeros(L, 2, BLOCKS, BS, 1, D)
    split = HeadSplit(4, 2, 2, 0)
    made = [create_shared_kv((L, 2, BLOCKS, BS, 1, D), torch.float32) for _ in range(2)]
    try:
        dest = sharded_destination(split, [m[2] for m in made])
        shards = open_shards(dest, lambda d: open_shm_pool(d.shm), cache, 2)
        assert [sh.heads for sh in shards] == [(0, 1), (1, 2)]
        # A rank holding head 1 only opens the pool that holds it.
        assert [sh.heads for sh in open_shards(dest, lambda d: open_shm_pool(d.shm), cache, 2, (1, 2))] == [(1, 2)]
        assert pool_split(dest, 2) == HeadSplitSpec(2, 1, 1) == spec_of(split)
        assert pool_id(dest).startswith("tp2:") and pool_id(dest) != pool_id(sharded_destination(
            split, [made[1][2], made[0][2]]))
        bad = decode_pb2.KVDestination()
        bad.CopyFrom(dest)
        bad.sharded.ranks[1].kv_head_start = 0  # rank 1 claims head 0 again: not the split TP=2 makes
        with pytest.raises(SharedKVAttachError) as e:
            open_shards(bad, lambda d: open_shm_pool(d.shm), cache, 2)
        assert e.value.reason == "split"
        with pytest.raises(SharedKVAttachError) as e:  # a model with other KV heads
            open_shards(dest, lambda d: open_shm_pool(d.shm), torch.zeros(L, 2, BLOCKS, BS, 2, D), 4)
        assert e.value.reason == "split"
        with pytest.raises(SharedKVAttachError) as e:  # another head dim
            open_shards(dest, lambda d: open_shm_pool(d.shm), torch.zeros(L, 2, BLOCKS, BS, 1, 2 * D), 2)
        assert e.value.reason == "shape"
    finally:
        for _, path, _ in made:
            os.unlink(path)


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *_: object, **kw: object) -> None:
        super().__init__(message)
        self.code, self.field = code, kw.get("field")


def _claim(pool: str, blocks: list[int], writer: HeadSplitSpec | None, pool_split_: HeadSplitSpec | None
           ) -> common_pb2.KVClaim:
    c = common_pb2.KVClaim(transport="shm", dest_block_ids=blocks, pool_id=pool)
    for field, spec in (("writer_split", writer), ("pool_split", pool_split_)):
        if spec is not None:
            getattr(c, field).CopyFrom(common_pb2.KVHeadSplit(tp_size=spec.tp_size,
                                                              kv_heads_per_rank=spec.kv_heads_per_rank,
                                                              replicas=spec.replicas))
    return c


def test_claim_names_both_head_splits_and_must_match_this_pool() -> None:
    layout = PageLayout.for_model("m", L, 2, D, BS, "fp32")
    r = SimpleNamespace(reservation_id="res-a", block_ids=[3, 4, 5])  # what check_claim reads of a Reservation
    own = HeadSplitSpec(2, 1, 1)
    kw = dict(pool="tp2:x", layout=layout, layouts=[layout], landing=None, split=own)
    got = check_claim(_claim("tp2:x", [3, 4, 5], HeadSplitSpec(4, 1, 2), own), r, _Rejected, **kw)
    assert got.splits == (HeadSplitSpec(4, 1, 2), own) and got.fingerprint != layout.fingerprint
    assert "tp4x1kvhr2->tp2x1kvh" in got.describe()
    with pytest.raises(_Rejected) as e:  # the writer thinks the pool holds all heads
        check_claim(_claim("tp2:x", [3, 4, 5], HeadSplitSpec(1, 2, 1), HeadSplitSpec(1, 2, 1)), r, _Rejected, **kw)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "tp1x2kvh" in str(e.value) \
        and "tp2x1kvh" in str(e.value)
    with pytest.raises(_Rejected) as e:  # no split named for a sharded pool
        check_claim(_claim("tp2:x", [3, 4, 5], None, None), r, _Rejected, **kw)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(_Rejected) as e:  # a writer split that does not cover the heads
        check_claim(_claim("tp2:x", [3, 4, 5], HeadSplitSpec(2, 2, 1), own), r, _Rejected, **kw)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(_Rejected) as e:  # another reservation's blocks
        check_claim(_claim("tp2:x", [6, 7, 8], HeadSplitSpec(2, 1, 1), own), r, _Rejected, **kw)
    assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
    # A TP=1 pool written by a TP=1 writer: no splits, the all-heads layout.
    plain = dict(kw, split=HeadSplitSpec(1, 2, 1))
    assert check_claim(_claim("tp2:x", [3, 4, 5], None, None), r, _Rejected, **plain) is layout


def test_a_destination_still_written_is_not_evicted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rank_pages, "ATTACHED_MAX", 2)
    pools = RankPools(_full(2), HeadSplit(4, 2, 2, 1))
    monkeypatch.setattr(pools, "shards", lambda raw, regions: ([Shard((0, 1), torch.zeros(1))], []))
    pools.attach(1, b"a", [])
    pools.attach(2, b"b", [])
    pools.attached(1)  # a WRITE of request 1: the most recently used now
    pools.attach(3, b"c", [])
    assert pools.attached(1) and pools.attached(3)
    with pytest.raises(ValueError, match="no destination attached as 2"):
        pools.attached(2)


INDEX_DIM = 8


def _index(codec: str, seed: int | None = None) -> IndexKeys:
    """An index-key pool of BLOCKS blocks (``seed``: filled with keys, else zero)."""
    pool = torch.zeros(IndexKeys.pool_shape(L, BLOCKS, BS, INDEX_DIM, codec, torch.float32), dtype=torch.uint8)
    keys = IndexKeys(L, BLOCKS, BS, INDEX_DIM, codec, torch.float32, pool)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        for layer in range(L):
            keys.store(layer, torch.randn(BLOCKS * BS, INDEX_DIM, generator=g), torch.arange(BLOCKS * BS))
    return keys


def _v32_decode(tp: int, codec: str, index_on: tuple[int, ...] | None = None):
    """A latent-attention decode at ``tp`` (one KV head, on every rank) whose ranks (those in ``index_on``; None:
    all) offer an index-key pool of ``codec`` beside their latent shard: (destination, latent pools, index pools,
    files)."""
    latent, index, files, dests = [], [], [], []
    for r in range(tp):
        t, t_path, t_dest = create_shared_kv((L, 2, BLOCKS, BS, 1, D), torch.float32)
        i, i_path, i_dest = create_shared_kv(IndexKeys.pool_shape(L, BLOCKS, BS, INDEX_DIM, codec, torch.float32),
                                             torch.uint8)
        region = _index(codec).region()
        dests.append(with_region_pool(t_dest, i_dest, region) if index_on is None or r in index_on else t_dest)
        latent.append(t)
        index.append(i)
        files += [t_path, i_path]
    dest = dests[0] if tp == 1 else sharded_destination(HeadSplit(4, 1, tp, 0), dests)
    return dest, latent, index, files


@pytest.mark.parametrize(("a", "b"), [(1, 2), (2, 1), (2, 2), (4, 2), (1, 4)])
def test_index_region_lands_whole_in_every_decode_rank(a: int, b: int) -> None:
    """Index keys are replicated under TP: the prefill ranks split each chunk's pages and each writes its share into
    every decode rank's index-key pool at the latent's block ids, bytes as stored; nothing else is touched."""
    latent = _full(1)
    keys = _index(FP8_CODEC, seed=5)  # every prefill rank holds the same keys
    dest, dec_latent, dec_index, files = _v32_decode(b, FP8_CODEC)
    try:
        src_blocks, dst_blocks = [1, 2, 3, 7, 8], [9, 10, 0, 4, 5]
        assert sorted(i for r in range(a) for i in range(*share(HeadSplit(4, 1, a, r), dst_blocks))) == \
            list(range(len(dst_blocks)))  # the shares split the chunk's pages, each page once
        raw = dest.SerializeToString(deterministic=True)
        for r in range(a):
            split = HeadSplit(4, 1, a, r)
            shards, regions = RankPools(latent, split).shards(raw, [(keys.region(), keys.kv_cache)])
            assert [x.kind for x in regions] == ["index"] * b  # every decode rank's index-key pool
            write_share(latent, split, shards, src_blocks, dst_blocks, regions)
        others = [x for x in range(BLOCKS) if x not in dst_blocks]
        for t, i in zip(dec_latent, dec_index, strict=True):
            assert torch.equal(t[:, :, dst_blocks], latent[:, :, src_blocks]) and not t[:, :, others].any()
            assert torch.equal(i[:, :, dst_blocks], keys.kv_cache[:, :, src_blocks]) and not i[:, :, others].any()
    finally:
        for f in files:
            os.unlink(f)


class _Runner:
    """What ShardWrites reads of a TP=1 runner: its cache, split and region pools (index keys, no draft)."""

    def __init__(self, cache: torch.Tensor, split: HeadSplit, index_keys: IndexKeys) -> None:
        self.kv_cache, self.model, self.index_keys, self.spec = cache, SimpleNamespace(tp_split=split), index_keys, None


def test_a_tp1_prefill_writes_a_sharded_decode_through_shard_writes() -> None:
    """Rank 0 of a TP=1 prefill (no collective): attach opens both decode ranks' latent and index-key pools, the
    chunk's write fills them, and a destination block outside the pools fails the write."""
    keys = _index("fp32", seed=6)
    runner = _Runner(_full(1), HeadSplit(4, 1, 1, 0), keys)
    dest, dec_latent, dec_index, files = _v32_decode(2, "fp32")
    try:
        writes = ShardWrites(runner)
        attached = writes.attach(dest)
        assert attached.blocks == BLOCKS and len(attached.regions) == 2
        writes.finish(writes.start(attached, [0, 5], [6, 11]))
        for t, i in zip(dec_latent, dec_index, strict=True):
            assert torch.equal(t[:, :, [6, 11]], runner.kv_cache[:, :, [0, 5]])
            assert torch.equal(i[:, :, [6, 11]], keys.kv_cache[:, :, [0, 5]]) and i[:, :, [6, 11]].any()
        with pytest.raises(TransferError, match="destination block 12"):
            writes.finish(writes.start(attached, [0], [BLOCKS]))
        assert all(f in files for f in shm_files(dest.sharded.ranks[1].pool))  # rank 0 removes rank 1's at exit
        assert len(shm_files(dest.sharded.ranks[1].pool)) == 2
    finally:
        for f in files:
            os.unlink(f)


@pytest.mark.parametrize("decode_tp", [1, 2])
def test_an_index_region_that_differs_or_is_missing_is_refused(decode_tp: int) -> None:
    """Prefill fp8-e4m3 index keys against decode's fp32 ones: refused at attach (reason index) naming both regions,
    before anything is written; a decode rank without an index-key pool is refused too, and not offered."""
    keys = _index(FP8_CODEC, seed=7)
    own = [(keys.region(), keys.kv_cache)]
    dest, _, dec_index, files = _v32_decode(decode_tp, "fp32")
    try:
        raw = dest.SerializeToString(deterministic=True)
        with pytest.raises(SharedKVAttachError) as e:
            RankPools(_full(1), HeadSplit(4, 1, 1, 0)).shards(raw, own)
        assert e.value.reason == "index"
        assert region_name(keys.region()) in str(e.value) and region_name(_index("fp32").region()) in str(e.value)
        assert not any(i.any() for i in dec_index)
        assert offers(dest, own)  # offered: the writer's check names the mismatch (its fingerprint differs too)
        with pytest.raises(SharedKVAttachError) as e:  # rank 0 refuses it before any rank opens a pool
            ShardWrites(_Runner(_full(1), HeadSplit(4, 1, 1, 0), keys)).attach(dest)
        assert e.value.reason == "index" and region_name(_index("fp32").region()) in str(e.value)
    finally:
        for f in files:
            os.unlink(f)
    dest, _, _, files = _v32_decode(2, FP8_CODEC, index_on=(0,))
    try:
        assert not offers(dest, own)
        with pytest.raises(SharedKVAttachError, match="decode rank 1: the decode offers no index pool") as e:
            RankPools(_full(1), HeadSplit(4, 1, 1, 0)).shards(dest.SerializeToString(deterministic=True), own)
        assert e.value.reason == "index"
    finally:
        for f in files:
            os.unlink(f)


def test_a_draft_region_is_refused_and_index_keys_are_carried() -> None:
    """A draft region (never in a TP engine) is not carried, naming the draft region only; index keys are carried by
    every rank-write transport (shm, cuda-ipc, and Mooncake: tests/engine/parallel/test_mooncake_regions.py)."""
    keys = _index("fp32")
    draft = Region("draft[m L1 kvh2 d8]", FP8_CODEC, 1)
    why = refused([(keys.region(), keys.kv_cache), (draft, torch.zeros(1))])
    assert why is not None and why.reason == "draft" and "draft" in str(why) and "index" not in str(why)
    assert refused([(keys.region(), keys.kv_cache)]) is None and refused([]) is None
