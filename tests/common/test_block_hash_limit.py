"""``iter_block_hashes(..., max_tokens=m)`` gives exactly the hashes of ``token_ids[:m]`` (the prefix-cache
lookup passes its limit instead of copying the prompt)."""

from __future__ import annotations

import pytest

from services.common.block_hash import LAZY_WINDOW_BLOCKS, block_hashes, iter_block_hashes

BS = 4
TOKENS = [(i * 7919) % 50000 for i in range(BS * (LAZY_WINDOW_BLOCKS + 3) + 2)]


@pytest.mark.parametrize("m", [-1, 0, 3, 4, 9, BS * LAZY_WINDOW_BLOCKS, BS * LAZY_WINDOW_BLOCKS + 5,
                               len(TOKENS), len(TOKENS) + 100])
def test_max_tokens_equals_hashing_the_slice(m: int) -> None:
    assert list(iter_block_hashes(TOKENS, BS, max_tokens=m)) == block_hashes(TOKENS[:max(0, m)], BS)
