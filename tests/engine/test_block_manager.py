from __future__ import annotations

import hashlib
import struct

import pytest

from services.common.block_hash import (
    ROOT_HASH,
    block_hashes,
    hash_block,
    hash_from_hex,
    hash_to_hex,
)
from services.engine.block_manager import BlockManager, NoFreeBlocksError
from services.engine.sequence import Sequence
from tests.engine.factories import make_block_manager, make_seq


def _prefill_all(bm: BlockManager, seq: Sequence) -> None:
    prefix = bm.get_computed_prefix(seq)
    assert bm.allocate(seq, len(seq.token_ids) - prefix[1], prefix=prefix)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.mark_computed(seq, seq.num_computed_tokens)


# ---- block_hash ---------------------------------------------------------------------------------


def test_hash_block_matches_spec_and_is_deterministic() -> None:
    tokens = [1, 2, 70000, -5]
    want = hashlib.blake2b(bytes(16) + struct.pack("<4i", *tokens), digest_size=16).digest()
    assert hash_block(None, tokens) == want
    assert hash_block(ROOT_HASH, tokens) == want
    assert hash_block(None, tuple(tokens)) == want
    assert len(want) == 16


def test_block_hashes_chain_full_blocks_only() -> None:
    tokens = list(range(100, 111))  # 2 full blocks of 4 + 3 leftover
    hs = block_hashes(tokens, 4)
    assert len(hs) == 2
    assert hs[0] == hash_block(None, tokens[0:4])
    assert hs[1] == hash_block(hs[0], tokens[4:8])
    # Same block content under a different parent hashes differently.
    assert hash_block(None, tokens[4:8]) != hs[1]
    # Continuing from a parent equals hashing the whole prefix.
    assert block_hashes(tokens[:4], 4) + block_hashes(tokens[4:], 4, parent=hs[0]) == hs
    assert block_hashes(tokens[:3], 4) == []


def test_hash_hex_roundtrip_and_bounds() -> None:
    h = hash_block(None, [1, 2, 3])
    assert hash_from_hex(hash_to_hex(h)) == h
    with pytest.raises(ValueError):
        hash_from_hex("abcd")
    with pytest.raises(OverflowError):
        hash_block(None, [2**31])
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)


# ---- allocation ---------------------------------------------------------------------------------


def test_allocate_and_free_restore_free_count() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    a, b = make_seq(10, seed=1), make_seq(5, seed=2)
    assert bm.allocate(a, 10) and bm.allocate(b, 5)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(5 / 8)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and b.block_table == []
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    bm.check_invariants([])


def test_allocate_grows_by_tokens_and_fails_without_change() -> None:
    bm = make_block_manager(num_blocks=3, block_size=4)
    seq = make_seq(6)
    assert bm.allocate(seq, 4)
    assert len(seq.block_table) == 1
    seq.num_computed_tokens = 4
    assert bm.allocate(seq, 2)  # tokens 4..5 -> second block
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 6
    assert bm.allocate(seq, 2)  # tokens 6..7 fit in block 2
    assert len(seq.block_table) == 2
    assert not bm.can_allocate(seq, 7)
    table = list(seq.block_table)
    assert not bm.allocate(seq, 7)  # would need 2 more blocks, 1 free
    assert seq.block_table == table and bm.num_free_blocks == 1
    bm.check_invariants([seq])


def test_prefix_hit_after_finished_seq_is_capped_to_leave_one_token() -> None:
    bm = make_block_manager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 blocks
    first = make_seq(prompt)
    _prefill_all(bm, first)
    bm.free(first)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 3

    same = make_seq(prompt)
    ids, n = bm.get_computed_prefix(same)
    assert n == 8 and len(ids) == 2  # 12 would leave nothing to compute
    assert bm.allocate(same, len(prompt) - n)
    assert same.num_computed_tokens == same.num_cached_tokens == 8
    assert same.block_table[:2] == ids
    assert bm.num_prefix_hit_tokens == 8 and bm.num_prefix_lookups == 2

    longer = make_seq([*prompt, 5])  # 13 tokens: all 3 full blocks hit
    ids, n = bm.get_computed_prefix(longer)
    assert n == 12 and len(ids) == 3
    assert bm.allocate(longer, 1, prefix=(ids, n))
    bm.check_invariants([same, longer])
    assert bm._ref_count[ids[0]] == 2  # shared by two live sequences


def test_hit_on_free_cached_block_takes_it_off_the_free_queue() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    seq = make_seq(list(range(9)))
    _prefill_all(bm, seq)
    bm.free(seq)
    assert bm.num_free_blocks == 4
    again = make_seq(list(range(9)))
    assert bm.allocate(again, 1)
    assert again.num_cached_tokens == 8
    assert bm.num_free_blocks == 1 and bm.num_cached_block_evictions == 0
    bm.check_invariants([again])


def test_freed_cached_blocks_are_reused_lru_tail_first() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    a, b = make_seq(list(range(100, 108))), make_seq(list(range(200, 208)))
    _prefill_all(bm, a)
    _prefill_all(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 4

    # Free order was a-tail, a-head, b-tail, b-head: new content takes them in that order.
    taken = []
    for i in range(4):
        s = make_seq([900 + i])
        assert bm.allocate(s, 1)
        taken.append(s.block_table[0])
    assert taken == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    assert bm.num_cached_block_evictions == 4 and bm.num_cached_blocks == 0
    bm.check_invariants()


def test_plain_free_blocks_are_taken_before_cached_ones() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq(list(range(100, 108)))
    _prefill_all(bm, a)
    bm.free(a)
    s = make_seq(list(range(300, 308)))
    assert bm.allocate(s, 8)
    assert bm.num_cached_block_evictions == 0 and bm.num_cached_blocks == 2
    assert bm.get_computed_prefix(make_seq(list(range(100, 109))))[1] == 8


def test_eviction_when_pool_is_full_drops_only_evicted_hashes() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    prompt = list(range(100, 116))  # fills the pool
    a = make_seq(prompt)
    _prefill_all(bm, a)
    bm.free(a)
    assert bm.num_cached_blocks == 4
    s = make_seq(list(range(500, 504)))
    assert bm.allocate(s, 4)  # evicts the tail block of `a`
    assert bm.num_cached_block_evictions == 1
    probe = make_seq([*prompt, 1])
    assert bm.get_computed_prefix(probe)[1] == 12  # chain still intact up to the evicted tail
    big = make_seq(list(range(600, 620)))
    assert not bm.can_allocate(big, 20)
    assert not bm.allocate(big, 20)
    bm.check_invariants([s])


def test_mark_computed_registers_only_full_computed_blocks_once() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(100, 110)))
    assert bm.allocate(seq, 10)
    bm.mark_computed(seq, 3)
    assert bm.num_cached_blocks == 0
    bm.mark_computed(seq, 6)
    assert bm.num_cached_blocks == 1
    bm.mark_computed(seq, 10)
    assert bm.num_cached_blocks == 2  # last block holds 2 tokens: not registered
    bm.mark_computed(seq, 10)
    assert bm.num_cached_blocks == 2
    # A second sequence computing the same content elsewhere does not re-register it.
    twin = make_seq(list(range(100, 110)))
    assert bm.allocate(twin, 8, prefix=([], 0))  # bypass the cache: compute a second copy
    bm.mark_computed(twin, 8)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 3
    bm.check_invariants([seq, twin])
    with pytest.raises(ValueError):
        bm.mark_computed(twin, 9)


def test_prefix_caching_disabled_never_hits() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4, prefix_caching=False)
    a = make_seq(list(range(9)))
    _prefill_all(bm, a)
    bm.free(a)
    b = make_seq(list(range(9)))
    assert bm.get_computed_prefix(b) == ([], 0)
    assert bm.allocate(b, 9) and b.num_cached_tokens == 0
    assert bm.num_cached_blocks == 0
    bm.check_invariants([b])


def test_kv_import_reports_leading_cached_blocks_without_cap() -> None:
    bm = make_block_manager(num_blocks=8, block_size=4)
    prompt = list(range(100, 112))
    a = make_seq(prompt)
    _prefill_all(bm, a)
    bm.free(a)

    same = make_seq(prompt)
    assert bm.allocate_for_kv_import(same) == 3  # whole prompt held; no "leave one token" cap
    assert same.num_cached_tokens == same.num_computed_tokens == 12
    assert len(same.block_table) == 3

    ext = make_seq([*prompt[:8], 1, 2, 3, 4, 5])
    assert bm.allocate_for_kv_import(ext) == 2
    assert len(ext.block_table) == 4 and ext.num_computed_tokens == 8
    bm.check_invariants([same, ext])

    cold = make_seq(list(range(700, 716)))
    with pytest.raises(NoFreeBlocksError, match="needs 4 free KV blocks"):
        bm.allocate_for_kv_import(cold)
    assert cold.block_table == [] and bm.num_free_blocks == 3
    with pytest.raises(ValueError):
        bm.allocate_for_kv_import(same)
    bm.free(same)
    bm.free(ext)
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache() -> None:
    bm = make_block_manager(num_blocks=4, block_size=4)
    a = make_seq(list(range(9)))
    _prefill_all(bm, a)
    bm.free(a)
    assert bm.reset_prefix_cache() == 2
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    bm.check_invariants([])
