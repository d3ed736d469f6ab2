"""Prefill's use of the kvstore: load prefix pages other instances computed, write new ones back.

Lookups and loads happen before the request is admitted (only when the store holds more leading
blocks than the local prefix cache); write-back runs in the background after the handoff, so the
first token never waits for it. Any kvstore failure is a miss, logged and counted, never an error
for the request.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from services.common.grpc_util import create_channel
from services.common.kvstore_client import KVStoreClient
from services.engine.block_hash import block_hashes
from services.engine.checksum import checksum
from services.engine.kv_layout import PageLayout

log = logging.getLogger(__name__)


class KVStorePrefix:
    def __init__(self, address: str, layout: PageLayout, page_shape: tuple[int, ...], dtype: torch.dtype,
                 timeout_s: float = 5.0) -> None:
        self.address = address
        self.layout = layout
        self.page_shape = page_shape
        self.dtype = dtype
        self.timeout_s = timeout_s
        self._channel = create_channel(address)
        self.client = KVStoreClient(self._channel)
        self._bg: set[asyncio.Task] = set()
        self.failures = 0

    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.layout.block_size)

    async def fetch(self, hashes: list[bytes], prompt_len: int, local_blocks: int) -> tuple[int, torch.Tensor | None]:
        """(blocks present in the store, pages for blocks [local_blocks, usable) or None)."""
        usable = min(len(hashes), (prompt_len - 1) // self.layout.block_size)  # one token is always computed
        fp = self.layout.fingerprint
        try:
            present = (await asyncio.wait_for(self.client.lookup(fp, hashes), self.timeout_s)).num_present
            want = min(present, usable)
            if want <= local_blocks:
                return present, None
            pages = await asyncio.wait_for(self.client.get(fp, hashes[local_blocks:want]), self.timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self.failures += 1
            log.warning("kvstore %s unusable for this request (%r): computing instead", self.address, e)
            return 0, None
        # Get streams the leading present pages; an eviction between Lookup and Get shortens it.
        good = []
        for want_hash, page in zip(hashes[local_blocks:want], pages, strict=False):
            if page.h != want_hash or len(page.data) != self.layout.page_bytes or checksum(page.data) != page.crc:
                break
            good.append(page.data)
        if not good:
            return present, None
        flat = torch.frombuffer(bytearray(b"".join(good)), dtype=self.dtype)
        return present, flat.view(len(good), *self.page_shape)

    def write_back(self, hashes: list[bytes], first_block: int, pages: torch.Tensor) -> None:
        """Put pages of blocks [first_block, first_block + P) in the background."""
        task = asyncio.create_task(self._put(hashes[first_block:first_block + pages.shape[0]], pages))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _put(self, hashes: list[bytes], pages: torch.Tensor) -> None:
        def encode() -> list[tuple[bytes, bytes, int]]:
            raw = pages.contiguous().view(torch.uint8).numpy()
            out = []
            for h, row in zip(hashes, raw, strict=True):
                data = row.tobytes()
                out.append((h, data, checksum(data)))
            return out

        try:
            items = await asyncio.to_thread(encode)
            await asyncio.wait_for(self.client.put(self.layout.fingerprint, items), 60.0)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self.failures += 1
            log.warning("kvstore write-back of %d pages failed: %r", len(hashes), e)

    async def close(self) -> None:
        for t in list(self._bg):
            await asyncio.wait({t}, timeout=5.0)
        await self._channel.close()
