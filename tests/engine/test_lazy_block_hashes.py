"""Lazy block hashing on the Reserve path: ``iter_block_hashes`` gives ``block_hashes``' chain one hash at a
time, and the prefix-cache lookup that uses it stops at the first miss without changing what is cached."""

from __future__ import annotations

import pytest

from services.common.block_hash import LAZY_WINDOW_BLOCKS, block_hashes, hash_block, iter_block_hashes
from tests.engine.factories import make_block_manager, make_seq

BS = 4


@pytest.mark.parametrize("n", [0, 3, 4, 9, BS * LAZY_WINDOW_BLOCKS, BS * LAZY_WINDOW_BLOCKS + 5,
                               BS * (2 * LAZY_WINDOW_BLOCKS + 3) + 1])
def test_iter_block_hashes_equals_block_hashes(n: int) -> None:
    tokens = [(i * 7919) % 50000 for i in range(n)]
    parent = hash_block(None, [1, 2, 3, 4])
    assert list(iter_block_hashes(tokens, BS)) == block_hashes(tokens, BS)
    assert list(iter_block_hashes(tokens, BS, parent)) == block_hashes(tokens, BS, parent)


def test_iter_block_hashes_converts_only_the_windows_it_is_asked_for() -> None:
    # an id outside int32 past the first window: the eager chain fails, the lazy one's first hash does not
    tokens = [5] * (BS * LAZY_WINDOW_BLOCKS) + [2**40] + [5] * (BS - 1)
    with pytest.raises(OverflowError):
        block_hashes(tokens, BS)
    it = iter_block_hashes(tokens, BS)
    assert next(it) == hash_block(None, [5] * BS)
    with pytest.raises(ValueError):
        next(iter_block_hashes(tokens, 0))


def test_kv_import_lookup_stops_at_the_first_miss_and_the_prompt_is_registered_in_full() -> None:
    bm = make_block_manager(num_blocks=4 * LAZY_WINDOW_BLOCKS, block_size=BS)
    n_shared = BS * (LAZY_WINDOW_BLOCKS + 2)  # the hits span more than one window
    first = make_seq(list(range(10, 10 + n_shared)) + [7] * (BS * 3 + 1))
    assert bm.allocate_for_kv_import(first) == 0
    bm.mark_computed(first, len(first.token_ids))
    second = make_seq(list(range(10, 10 + n_shared)) + [8] * (BS * 3 + 2))
    hits = bm.allocate_for_kv_import(second)
    assert hits == n_shared // BS
    assert second.block_table[:hits] == first.block_table[:hits]
    assert second.num_cached_tokens == n_shared
    assert bm._seq_hashes[second.seq_id] == block_hashes(second.token_ids, BS)[:hits]
    bm.mark_computed(second, len(second.token_ids))  # registers the blocks past the hits
    assert bm._seq_hashes[second.seq_id] == block_hashes(second.token_ids, BS)
    bm.check_invariants([first, second])
    third = make_seq(list(second.token_ids))
    assert bm.allocate_for_kv_import(third) == len(second.token_ids) // BS
    bm.check_invariants([first, second, third])


def test_lookup_of_a_missing_prompt_hashes_only_its_first_window() -> None:
    bm = make_block_manager(num_blocks=8, block_size=BS)
    # the eager lookup converted every token (and failed on this one); the lazy one stops at block 0's miss
    seq = make_seq([5] * (BS * LAZY_WINDOW_BLOCKS) + [2**40] + [5] * BS)
    assert bm._lookup(seq, len(seq.token_ids)) == ([], [])
