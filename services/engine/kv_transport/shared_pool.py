"""``shm`` (CPU) and ``cuda-ipc`` (GPU) transports: the prefill copies pages straight into the reserved
blocks of a same-host decode's pool (opened from its typed destination, see shared_kv.py); the PushKV
stream carries the claim and descriptors only."""

from __future__ import annotations

import torch

from services.engine.kv_transport.base import KVSender, PageWriter
from services.engine.shared_kv import copy_pages

ONEOF_OF = {"shm": "shm", "cuda-ipc": "cuda_ipc", "mooncake": "mooncake"}
"""Transport name -> the KVDestination.pool case it writes into."""


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


def copy_pages_peer(src_cache: torch.Tensor, src_blocks: list[int], dst_cache: torch.Tensor,
                    dst_blocks: list[int]) -> None:
    """copy_pages between two GPUs in three ops, however the blocks fall into runs: gather them on the
    source GPU, one contiguous device-to-device copy (the driver's peer copy over NVLink/PCIe), scatter on
    the pool's GPU (a kernel there, in the context that holds the pool's IPC mapping). One copy per run
    and (layer, K/V) plane instead costs ~100 us of host time each across devices: with decode's blocks
    fragmented, ~0.5 s per 2048-token chunk. Same bounds checks as copy_pages."""
    for blocks, cache in ((src_blocks, src_cache), (dst_blocks, dst_cache)):
        if any(not 0 <= x < cache.shape[2] for x in blocks):
            raise ValueError(f"block ids {blocks} are not all inside a pool of {cache.shape[2]} blocks")
    staged = src_cache.index_select(2, torch.tensor(src_blocks, device=src_cache.device)).to(dst_cache.device)
    dst_cache.index_copy_(2, torch.tensor(dst_blocks, device=dst_cache.device), staged)
