"""Block placement (services/engine/block_manager.py): a sequence's blocks are consecutive pool blocks where the
free blocks allow it (CPU decode attention then reads its keys as one slice), without taking a cached block out of
LRU order or changing what is counted."""

from __future__ import annotations

import itertools

import pytest

import services.engine.block_manager as bm_mod
from services.engine.block_manager import BlockManager
from services.engine.sequence import Sequence
from tests.engine.factories import make_block_manager, make_seq


def _grow(bm: BlockManager, seq: Sequence, tokens: int) -> None:
    """Decode ``tokens`` tokens one at a time (the scheduler's allocate per step)."""
    for _ in range(tokens):
        assert bm.allocate(seq, 1)
        seq.num_computed_tokens += 1
        seq.token_ids.append(7)


def _consecutive(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_interleaved_growth_keeps_each_sequence_consecutive() -> None:
    bm = make_block_manager(num_blocks=64, block_size=4)
    a, b = make_seq(6, seed=1), make_seq(5, seed=2)
    for s in (a, b):
        assert bm.allocate(s, len(s.token_ids))
        s.num_computed_tokens = len(s.token_ids)
    assert a.block_table == [0, 1]
    assert b.block_table[0] > 2  # b starts inside the free run, leaving a room to grow
    for _ in range(12):  # a and b decode in the same steps
        _grow(bm, a, 1)
        _grow(bm, b, 1)
    assert _consecutive(a.block_table) and _consecutive(b.block_table)
    assert len(a.block_table) == 5 and len(b.block_table) == 5
    bm.check_invariants([a, b])


def test_a_new_sequence_takes_the_longest_free_run_after_fragmentation() -> None:
    bm = make_block_manager(num_blocks=16, block_size=4, prefix_caching=False)
    seqs = [make_seq(4, seed=i) for i in range(8)]
    for s in seqs:
        assert bm.allocate(s, 4)
    assert len({s.block_table[0] for s in seqs}) == 8
    assert all(abs(a.block_table[0] - b.block_table[0]) > 1 for a, b in itertools.pairwise(seqs))
    for s in seqs[1:6:2]:  # free three single blocks
        bm.free(s)
    new = make_seq(12, seed=99)
    assert bm.allocate(new, 12)
    assert _consecutive(new.block_table)  # a free run of 3 exists (8 of 16 used, spread out): it gets one
    bm.check_invariants([s for i, s in enumerate(seqs) if i not in (1, 3, 5)] + [new])
    filler = make_seq(4 * bm.num_free_blocks, seed=5)
    assert bm.allocate(filler, 4 * bm.num_free_blocks)  # the holes still serve when nothing else is left
    assert bm.num_free_blocks == 0


def test_fresh_blocks_follow_a_prefix_hit_and_cached_blocks_stay_in_lru_order() -> None:
    bm = make_block_manager(num_blocks=12, block_size=4)
    first = make_seq(list(range(10, 19)))  # 9 tokens: 2 full cached blocks + 1
    prefix = bm.get_computed_prefix(first)
    assert bm.allocate(first, 9 - prefix[1], prefix=prefix)
    first.num_computed_tokens = 9
    bm.mark_computed(first, 9)
    bm.free(first)  # blocks 0, 1 cached free; 2 plain free again
    again = make_seq([*range(10, 18), 50, 51])
    prefix = bm.get_computed_prefix(again)
    assert prefix == ([0, 1], 8)
    assert bm.allocate(again, 2, prefix=prefix)
    assert again.block_table == [0, 1, 2]  # the fresh block follows the hits
    evictions = bm.num_cached_block_evictions
    bm.free(again)
    other = make_seq(44, seed=3)  # 11 blocks: the 10 plain ones, then one cached
    assert bm.allocate(other, 44)
    assert bm.num_cached_block_evictions == evictions + 1
    assert bm.get_computed_prefix(make_seq(list(range(10, 19))))[0] == [0]  # block 1 (freed first) went first
    bm.check_invariants([other])


def test_kv_import_allocation_is_consecutive() -> None:
    bm = make_block_manager(num_blocks=32, block_size=4)
    live = make_seq(8, seed=4)
    assert bm.allocate(live, 8)
    imported = make_seq(30, seed=6)
    assert bm.allocate_for_kv_import(imported) == 0
    assert _consecutive(imported.block_table) and not set(imported.block_table) & set(live.block_table)
    bm.check_invariants([live, imported])


def test_large_free_pools_skip_the_run_scan(monkeypatch: pytest.MonkeyPatch) -> None:

    bm = make_block_manager(num_blocks=64, block_size=4)
    a = make_seq(6, seed=1)
    assert bm.allocate(a, 6)
    monkeypatch.setattr(bm_mod, "RUN_SCAN_MAX", 8)  # 62 plain free blocks: more than the cap
    b = make_seq(8, seed=2)
    assert bm.allocate(b, 8)
    assert b.block_table == [2, 3]  # the oldest plain free block, no mid-run placement; still consecutive
    bm.check_invariants([a, b])
