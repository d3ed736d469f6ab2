"""Full-head pages from per-rank head shards, and back (the instance boundary is TP-independent).

Every KV page that leaves or enters a tensor-parallel instance holds ALL KV heads
[P, layers, 2, block_size, kv_heads, head_dim], the layout a TP=1 engine packs, so a prefill at any TP
degree hands pages to a decode at any other and the kvstore keeps one copy for all of them.
"""

from __future__ import annotations

import torch

from services.engine.parallel.split import HeadSplit


def assemble(parts: list[torch.Tensor], split: HeadSplit) -> torch.Tensor:
    """Every rank's [P, L, 2, bs, local kv heads, D] -> [P, L, 2, bs, kv heads, D]. Ranks
    0, R, 2R, ... (R = replicas of a head) hold disjoint head ranges covering all heads in order."""
    return torch.cat(parts[:: split.kv_replicas], dim=4)


def my_heads(full: torch.Tensor, split: HeadSplit) -> torch.Tensor:
    a, b = split.kv_range
    return full[:, :, :, :, a:b].contiguous()


def per_rank_heads(full: torch.Tensor, split: HeadSplit) -> list[torch.Tensor]:
    """Each rank's head slice of full-head pages, in rank order (what an import scatters)."""
    return [my_heads(full, split.at(r)) for r in range(split.tp_size)]


def as_cache(pages: torch.Tensor) -> torch.Tensor:
    """[P, L, 2, bs, H, D] pages viewed as a P-block cache [L, 2, P, bs, H, D] (for the fp8 kernels)."""
    return pages.permute(1, 2, 0, 3, 4, 5).contiguous()


def from_cache(cache: torch.Tensor) -> torch.Tensor:
    return cache.permute(2, 0, 1, 3, 4, 5).contiguous()
