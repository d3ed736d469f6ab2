"""``shm`` (CPU) and ``cuda-ipc`` (GPU) transports: the prefill copies pages straight into the reserved
blocks of a same-host decode's pool (opened from its typed destination, see shared_kv.py); the PushKV
stream carries the claim and descriptors only."""

from __future__ import annotations

import torch

from services.engine.kv_transport.base import KVSender, PageWriter
from services.engine.shared_kv import copy_pages


class SharedPoolWriter(PageWriter):
    """One request's writer into an opened same-host pool. ``write`` copies at once (engine thread):
    the pages have landed when it returns (a CUDA copy is synchronized)."""

    def __init__(self, transport: str, pool_id: str, src: torch.Tensor, pool: torch.Tensor,
                 dest_blocks: list[int]) -> None:
        self.transport = transport
        self.pool_id = pool_id
        self.src = src
        self.pool = pool
        self.dest = dest_blocks
        self.sender: KVSender | None = None

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        dest = self.dest[first_block:first_block + len(src_blocks)]
        if self.pool.device != self.src.device:  # cuda-ipc into a decode on another GPU of this host
            copy_pages_peer(self.src, src_blocks, self.pool, dest)
        else:
            copy_pages(self.src, src_blocks, self.pool, dest)
        if self.src.is_cuda:  # the pages must have landed before the descriptor tells decode they have
            torch.cuda.current_stream(self.pool.device).synchronize()  # the last op ran on the pool's GPU
        return None


def check_blocks(blocks: list[int], total: int, side: str) -> None:
    """ValueError unless every block id is inside a pool of ``total`` blocks (``side``: which pool, for the message)."""
    bad = next((x for x in blocks if not 0 <= x < total), None)
    if bad is not None:
        raise ValueError(f"{side} block {bad} is outside the pool's {total} blocks")


def copy_pages_peer(src_cache: torch.Tensor, src_blocks: list[int], dst_cache: torch.Tensor, dst_blocks: list[int],
                    src_heads: tuple[int, int] | None = None, dst_heads: tuple[int, int] | None = None) -> None:
    """dst_cache[:, :, dst_blocks[i], :, c:d] = src_cache[:, :, src_blocks[i], :, a:b] (caches [L, 2, blocks, bs,
    heads, D]; heads None: all) in three ops, however the blocks fall into runs: gather them on the source GPU,
    one contiguous device-to-device copy (the driver's peer copy over NVLink/PCIe), scatter on the pool's GPU
    (a kernel there, in the context that holds the pool's IPC mapping). One copy per run and (layer, K/V) plane
    instead costs ~100 us of host time each across devices: with decode's blocks fragmented, ~0.5 s per
    2048-token chunk. Block ids are checked against both caches. The one gather-copy-scatter of the side
    transports: a whole pool (cuda-ipc), another region's pool (region_pools.py), a rank's heads (parallel/rank_pages.py)."""
    check_blocks(src_blocks, src_cache.shape[2], "source")
    check_blocks(dst_blocks, dst_cache.shape[2], "destination")
    src = src_cache if src_heads is None else src_cache[:, :, :, :, src_heads[0]:src_heads[1]]
    dst = dst_cache if dst_heads is None else dst_cache[:, :, :, :, dst_heads[0]:dst_heads[1]]
    staged = src.index_select(2, torch.tensor(src_blocks, device=src.device)).to(dst.device)
    dst.index_copy_(2, torch.tensor(dst_blocks, device=dst.device), staged)
