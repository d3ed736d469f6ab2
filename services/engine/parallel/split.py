"""Which part of the model each tensor-parallel rank owns (pure arithmetic, no torch).

Query heads split evenly: rank r owns q heads [r*H/N, (r+1)*H/N). KV heads split evenly when there are
at least N of them; with fewer, each KV head is replicated on N/KVH consecutive ranks, so every rank
holds exactly the KV heads its query heads read (GQA groups never straddle ranks).
"""

from __future__ import annotations

from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A model shape that this tensor-parallel size cannot split (the message names both)."""


def even_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n rows split evenly (size divides n)."""
    per = n // size
    return rank * per, (rank + 1) * per


def padded_range(n: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, end, rows) of rank's share of n rows padded up to a multiple of size: rows is the padded
    share (ceil(n/size)); end <= n, so the last rank may hold rows - (end - start) padding rows."""
    per = -(-n // size)
    start = min(n, rank * per)
    return start, min(n, start + per), per


@dataclass(frozen=True)
class HeadSplit:
    num_heads: int
    num_kv_heads: int
    tp_size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        n, h, kvh = self.tp_size, self.num_heads, self.num_kv_heads
        if n < 1 or not 0 <= self.rank < n:
            raise TensorParallelError(f"rank {self.rank} of tensor-parallel size {n}")
        if h % n:
            raise TensorParallelError(f"tensor-parallel size {n} does not divide the {h} attention heads")
        if (kvh % n) if kvh >= n else (n % kvh):
            raise TensorParallelError(f"tensor-parallel size {n} and {kvh} KV heads: one must divide the other")

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def kv_replicas(self) -> int:
        """Ranks that hold the same KV head (1 unless KV heads < tp_size)."""
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def q_range(self) -> tuple[int, int]:
        return even_range(self.num_heads, self.tp_size, self.rank)

    @property
    def kv_range(self) -> tuple[int, int]:
        """[start, end) of the KV heads this rank holds."""
        start = self.rank // self.kv_replicas * self.local_kv_heads
        return start, start + self.local_kv_heads

    def at(self, rank: int) -> HeadSplit:
        return HeadSplit(self.num_heads, self.num_kv_heads, self.tp_size, rank)

    def kv_owners(self) -> list[int]:
        """For each KV head, the first rank that holds it (the one whose copy full-head pages take)."""
        return [h // self.local_kv_heads * self.kv_replicas for h in range(self.num_kv_heads)]
