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
        copy_pages(self.src, src_blocks, self.pool, self.dest[first_block:first_block + len(src_blocks)])
        if self.src.is_cuda:  # the pages must have landed before the descriptor tells decode they have
            torch.cuda.current_stream(self.src.device).synchronize()
        return None
