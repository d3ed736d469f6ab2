"""Paged KV cache bookkeeping: block ids, reference counts and the prefix cache. No tensors.

Block ids are ``0..num_blocks-1``, indices into the model runner's KV tensors.

Invariants (``check_invariants`` verifies them):
  * Every block is either in use (``ref_count > 0``) or free (``ref_count == 0``), never both.
  * A free block sits in exactly one free queue: ``_free_plain`` (no cached content) or
    ``_free_cached`` (content registered in the prefix cache, LRU order, oldest first).
  * Placement only (nothing may rely on it): a sequence's new blocks follow its previous block when that
    one is plain free, and a sequence's first fresh block starts a run of plain free blocks, so CPU decode
    attention reads most sequences' keys as one slice of the pool (attention.py). Cached free blocks are
    never taken out of LRU order for this.
  * ``_block_hash[b] is not None`` iff ``_hash_to_block[_block_hash[b]] == b``: a block is registered
    under at most one hash and a hash names at most one block. Only full, computed blocks register.
  * A cached free block keeps its content until it is taken for new content (then its hash entry is
    dropped: an eviction); a prefix hit on it takes it off the free queue instead (ref 0 -> 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from services.common.block_hash import block_hashes, iter_block_hashes
from services.engine.sequence import Sequence

RUN_SCAN_MAX = 4096
"""Plain free blocks up to which a new sequence's placement looks for the longest free run (a CPU pool of the
default 1 GiB holds ~2,900 blocks of the embedded model; large GPU pools take the oldest free block instead)."""


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV blocks for a request."""

    def __init__(self, seq: Sequence, needed: int, free: int) -> None:
        super().__init__(
            f"request {seq.request_id}: needs {needed} free KV blocks for {len(seq.token_ids)} tokens, "
            f"only {free} free"
        )
        self.needed = needed
        self.free = free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

        self._ref_count: list[int] = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._hash_to_block: dict[bytes, int] = {}
        self._free_plain: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # seq_id -> chained hashes of that sequence's leading full computed blocks.
        self._seq_hashes: dict[int, list[bytes]] = {}

        self.num_prefix_lookups = 0
        """Prefix-cache lookups made on first allocation."""
        self.num_prefix_queried_tokens = 0
        """Tokens offered to those lookups."""
        self.num_prefix_hit_tokens = 0
        """Tokens served from the prefix cache."""
        self.num_cached_block_evictions = 0
        """Cached free blocks overwritten with new content."""

    # ---- capacity -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0), in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache ---------------------------------------------------------------------------

    def _lookup(self, seq: Sequence, max_tokens: int) -> tuple[list[int], list[bytes]]:
        """Longest run of cached blocks matching the leading full blocks of seq[:max_tokens]."""
        if not self.enable_prefix_caching or max_tokens < self.block_size:
            return [], []
        # Lazy: a prompt whose first block misses hashes one window, not the whole prompt (mark_computed
        # hashes the blocks past the hits once their KV is written).
        ids: list[int] = []
        hashes: list[bytes] = []
        for h in iter_block_hashes(seq.token_ids, self.block_size, max_tokens=max_tokens):
            b = self._hash_to_block.get(h)
            if b is None:
                break
            ids.append(b)
            hashes.append(h)
        return ids, hashes

    def get_computed_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Cached block ids for seq's leading full blocks and the number of tokens they hold.

        Leaves at least one token to compute (num_cached_tokens <= len(seq.token_ids) - 1) so the last
        token's logits exist. Pure lookup: takes no references and changes no counters.
        """
        ids, _ = self._lookup(seq, len(seq.token_ids) - 1)
        return ids, len(ids) * self.block_size

    # ---- allocation -----------------------------------------------------------------------------

    def _num_needed(self, seq: Sequence, hit_ids: list[int], num_new_tokens: int) -> tuple[int, int]:
        """(fresh blocks to take, free blocks the hits would take off the free queues)."""
        num_computed = len(hit_ids) * self.block_size if not seq.block_table else seq.num_computed_tokens
        held = len(seq.block_table) + len(hit_ids)
        fresh = max(0, self.blocks_for_tokens(num_computed + num_new_tokens) - held)
        free_hits = sum(1 for b in hit_ids if self._ref_count[b] == 0)
        return fresh, free_hits

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether ``allocate(seq, num_new_tokens)`` would succeed now."""
        hit_ids = self.get_computed_prefix(seq)[0] if not seq.block_table else []
        fresh, free_hits = self._num_needed(seq, hit_ids, num_new_tokens)
        return fresh + free_hits <= self.num_free_blocks

    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix: tuple[list[int], int] | None = None
    ) -> bool:
        """Grow seq.block_table to cover ``num_computed_tokens + num_new_tokens`` tokens.

        On the first allocation (empty block table) prefix-cache hits are applied first and set
        ``seq.num_computed_tokens = seq.num_cached_tokens = <hit tokens>``; ``num_new_tokens`` then
        counts tokens after the hits. ``prefix`` may pass in this step's ``get_computed_prefix(seq)``
        to avoid hashing twice. Returns False and changes nothing when blocks are short.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        first = not seq.block_table
        hit_ids: list[int] = []
        hit_hashes: list[bytes] = []
        if first:
            if seq.num_computed_tokens != 0:
                raise ValueError(
                    f"seq {seq.seq_id} has no blocks but {seq.num_computed_tokens} computed tokens"
                )
            if prefix is not None:
                hit_ids = prefix[0]
            else:
                hit_ids, hit_hashes = self._lookup(seq, len(seq.token_ids) - 1)
        fresh, free_hits = self._num_needed(seq, hit_ids, num_new_tokens)
        if fresh + free_hits > self.num_free_blocks:
            return False

        if first:
            if hit_ids and not hit_hashes:
                hit_hashes = [self._block_hash[b] for b in hit_ids]  # type: ignore[misc]
            self._take_hits(seq, hit_ids, hit_hashes, len(seq.token_ids) - 1)
        self._append_fresh(seq, fresh)
        return True

    def allocate_for_kv_import(self, seq: Sequence) -> int:
        """Decode side: blocks for all of ``seq.token_ids`` at once, to be filled by a KV import.

        Prefix hits count with no "leave one token" cap. Returns how many leading blocks already hold
        valid KV (the prefill need not send them); sets num_computed_tokens/num_cached_tokens to the
        tokens they hold. Raises NoFreeBlocksError (changing nothing) when blocks are short.
        """
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"seq {seq.seq_id} already has blocks; KV import needs a fresh sequence")
        hit_ids, hit_hashes = self._lookup(seq, len(seq.token_ids))
        fresh, free_hits = self._num_needed(seq, hit_ids, len(seq.token_ids) - len(hit_ids) * self.block_size)
        if fresh + free_hits > self.num_free_blocks:
            raise NoFreeBlocksError(seq, fresh + free_hits, self.num_free_blocks)
        self._take_hits(seq, hit_ids, hit_hashes, len(seq.token_ids))
        self._append_fresh(seq, fresh)
        return len(hit_ids)

    def _take_hits(self, seq: Sequence, hit_ids: list[int], hit_hashes: list[bytes], queried: int) -> None:
        """Reference the hit blocks as seq's leading blocks and record the lookup."""
        if self.enable_prefix_caching:
            self.num_prefix_lookups += 1
            self.num_prefix_queried_tokens += max(0, queried)
        for b in hit_ids:
            if self._ref_count[b] == 0:
                del self._free_cached[b]
            self._ref_count[b] += 1
            seq.block_table.append(b)
        num_hit_tokens = len(hit_ids) * self.block_size
        seq.num_computed_tokens = seq.num_cached_tokens = num_hit_tokens
        self.num_prefix_hit_tokens += num_hit_tokens
        self._seq_hashes[seq.seq_id] = list(hit_hashes)

    def _append_fresh(self, seq: Sequence, n: int) -> None:
        """Take n free blocks onto seq's table, each the block after the one before it where that one is plain
        free (a sequence with no blocks yet starts where ``_run_start`` says)."""
        if n <= 0:
            return
        want = seq.block_table[-1] + 1 if seq.block_table else self._run_start(n)
        for _ in range(n):
            b = self._take_free(want)
            seq.block_table.append(b)
            want = b + 1

    def _run_start(self, n: int) -> int:
        """Where a new sequence's n blocks go: the start of the longest run of consecutive plain free blocks
        (the lowest of equals), moved in to the middle of the spare room when the block before the run is in use
        (a live sequence may grow into it). The oldest plain free block (-1 when none) when it already starts a
        run of n after an unused block, or when more than RUN_SCAN_MAX blocks are plain free (the scan is
        O(plain free blocks), ~0.5 ms at 2,900 in CPython, once per new sequence)."""
        head = next(iter(self._free_plain), -1)
        if head < 0 or len(self._free_plain) > RUN_SCAN_MAX or (
                (head == 0 or self._ref_count[head - 1] == 0)
                and all(head + i in self._free_plain for i in range(1, n))):
            return head
        best, best_len, start, prev = -1, 0, -1, -2
        for b in sorted(self._free_plain):
            if b != prev + 1:
                start = b
            prev = b
            if b - start + 1 > best_len:
                best, best_len = start, b - start + 1
        if best > 0 and self._ref_count[best - 1] > 0 and best_len > n:
            best += (best_len - n) // 2
        return best

    def _take_free(self, want: int = -1) -> int:
        """A free block for new content: ``want`` when it is plain free, else a plain one (oldest freed first),
        else the least recently freed cached one."""
        if want in self._free_plain:
            del self._free_plain[want]
            b = want
        elif self._free_plain:
            b, _ = self._free_plain.popitem(last=False)
        else:
            b, _ = self._free_cached.popitem(last=False)
            h = self._block_hash[b]
            assert h is not None
            del self._hash_to_block[h]
            self._block_hash[b] = None
            self.num_cached_block_evictions += 1
        self._ref_count[b] = 1
        return b

    def mark_computed(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register in the prefix cache every full block within seq's first ``num_computed_tokens``.

        Call after the tokens' KV has been written. Does not change ``seq.num_computed_tokens``. A
        block whose content is already cached under another block stays unregistered (the first
        copy keeps serving hits).
        """
        if num_computed_tokens > len(seq.block_table) * self.block_size:
            raise ValueError(
                f"seq {seq.seq_id}: {num_computed_tokens} computed tokens exceed its "
                f"{len(seq.block_table)} blocks of {self.block_size}"
            )
        if not self.enable_prefix_caching:
            return
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        num_full = min(num_computed_tokens, len(seq.token_ids)) // self.block_size
        if num_full <= len(hashes):
            return
        start = len(hashes) * self.block_size
        parent = hashes[-1] if hashes else None
        new = block_hashes(seq.token_ids[start : num_full * self.block_size], self.block_size, parent)
        for i, h in enumerate(new, start=len(hashes)):
            b = seq.block_table[i]
            assert self._block_hash[b] in (None, h), f"block {b} of seq {seq.seq_id} holds other content"
            if self._block_hash[b] is None and h not in self._hash_to_block:
                self._block_hash[b] = h
                self._hash_to_block[h] = b
        hashes.extend(new)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references (tail first, so tail blocks are evicted first) and clear its table.

        Cached content stays reusable until evicted. Does not change ``seq.num_computed_tokens``.
        """
        for b in reversed(seq.block_table):
            self._ref_count[b] -= 1
            assert self._ref_count[b] >= 0, f"block {b} freed more often than taken"
            if self._ref_count[b] == 0:
                if self._block_hash[b] is not None:
                    self._free_cached[b] = None
                else:
                    self._free_plain[b] = None
        seq.block_table.clear()
        self._seq_hashes.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> int:
        """Forget every cached free block's content; returns how many were dropped."""
        dropped = 0
        while self._free_cached:
            b, _ = self._free_cached.popitem(last=False)
            del self._hash_to_block[self._block_hash[b]]  # type: ignore[arg-type]
            self._block_hash[b] = None
            self._free_plain[b] = None
            dropped += 1
        return dropped

    # ---- checks ---------------------------------------------------------------------------------

    def check_invariants(self, seqs: Iterable[Sequence] | None = None) -> None:
        """Assert the module invariants; with ``seqs`` (every live sequence holding blocks), also that
        each block's ref_count equals the number of block tables naming it. O(num_blocks)."""
        plain = set(self._free_plain)
        assert not plain & self._free_cached.keys(), "block in both free queues"
        for b in range(self.num_blocks):
            ref, h = self._ref_count[b], self._block_hash[b]
            assert ref >= 0, f"block {b}: ref_count {ref}"
            is_free = b in plain or b in self._free_cached
            assert is_free == (ref == 0), f"block {b}: ref_count {ref} but free={is_free}"
            if b in plain:
                assert h is None, f"block {b}: plain free block carries a hash"
            if b in self._free_cached:
                assert h is not None, f"block {b}: cached free block has no hash"
            if h is not None:
                assert self._hash_to_block.get(h) == b, f"block {b}: hash not mapped back to it"
        assert len(self._hash_to_block) == sum(h is not None for h in self._block_hash), "stale hash entries"
        if seqs is not None:
            refs = [0] * self.num_blocks
            for seq in seqs:
                for b in seq.block_table:
                    refs[b] += 1
            assert refs == self._ref_count, "ref counts differ from the live block tables"
