"""Prefill's use of the kvstore: load prefix pages other instances computed, write new ones back.

Lookups and loads happen before the request is admitted (only when the store holds more leading
blocks than the local prefix cache); write-back runs in the background after the handoff, so the
first token never waits for it. Any kvstore failure is a miss, logged and counted, never an error
for the request. After a failure the store is skipped for ``retry_s`` (no request waits on a dead
store), then tried again: the channel reconnects on its own (backoff capped at a few seconds), so
reuse resumes once the store is back.

Pages loaded are checked before they enter the prefix cache: the key (layout fingerprint and block
hash) must be the one asked for, the size one page of this layout, and the CRC-32 must verify.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass, field

import grpc
import torch

from services.common.block_hash import block_hashes
from services.common.checksum import checksum
from services.common.grpc_util import create_channel, rpc_error_summary
from services.common.kvstore_client import KVStoreClient
from services.common.kvstore_pages import serialized_pieces
from services.common.tls import TLSConfig
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import PageExport

log = logging.getLogger(__name__)

RECONNECT_BACKOFF_MS = (500, 2000)
"""(first, longest) wait between reconnect attempts to a kvstore that went away (milliseconds)."""
WRITE_BACK_TIMEOUT_S = 60.0
"""Longest one background Put may take (seconds)."""
_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(eq=False)
class KVStorePrefix:
    """``on_error(reason)`` is told of every failure or skip (the prefill's kvstore-errors metric)."""

    address: str
    layout: PageLayout
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    _: KW_ONLY
    tls: InitVar[TLSConfig | None] = None
    timeout_s: float = 2.0
    retry_s: float = 1.0
    max_pending_writes: int = 8
    on_error: Callable[[str], None] | None = None
    failures: int = field(default=0, init=False)
    _bg: set[asyncio.Task] = field(default_factory=set, init=False, repr=False)
    _down_until: float = field(default=0.0, init=False, repr=False)
    """time.monotonic() before which the store is not asked."""

    def __post_init__(self, tls: TLSConfig | None) -> None:
        first, longest = RECONNECT_BACKOFF_MS
        self._channel = create_channel(self.address, tls=tls, options=[
            ("grpc.initial_reconnect_backoff_ms", first), ("grpc.min_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", longest)])
        self.client = KVStoreClient(self._channel, max_page_bytes=self.layout.page_bytes)

    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.layout.block_size)

    def _failed(self, reason: str, what: str, err: BaseException) -> None:
        """Count a failure; one that says the store is unreachable or stuck also backs off ``retry_s``."""
        self.failures += 1
        self._count(reason)
        unreachable = isinstance(err, TimeoutError) or (
            isinstance(err, grpc.aio.AioRpcError) and err.code() in _UNREACHABLE)
        if unreachable:
            self._down_until = time.monotonic() + self.retry_s
        log.warning("kvstore %s: %s failed (%s)%s", self.address, what, rpc_error_summary(err),
                    f"; going on without it for {self.retry_s:.1f} s" if unreachable else "")

    def _count(self, reason: str) -> None:
        if self.on_error is not None:
            self.on_error(reason)

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    async def fetch(self, hashes: list[bytes], prompt_len: int, local_blocks: int) -> tuple[int, torch.Tensor | None]:
        """(blocks present in the store, pages for blocks [local_blocks, usable) or None)."""
        if not self.available:
            self._count("down")
            return 0, None
        usable = min(len(hashes), (prompt_len - 1) // self.layout.block_size)  # one token is always computed
        fp = self.layout.fingerprint
        try:
            present = (await asyncio.wait_for(self.client.lookup(fp, hashes), self.timeout_s)).num_present
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._failed("lookup", "Lookup", e)
            return 0, None
        want = min(present, usable)
        if want <= local_blocks:
            return present, None
        try:
            pages = await asyncio.wait_for(self.client.get(fp, hashes[local_blocks:want]), self.timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError, ValueError) as e:  # ValueError: a malformed piece stream
            self._failed("get", "Get", e)
            return present, None
        # Get streams the leading present pages; an eviction between Lookup and Get shortens it.
        good = []
        for want_hash, page in zip(hashes[local_blocks:want], pages, strict=False):
            if (page.fp != fp or page.h != want_hash or len(page.data) != self.layout.page_bytes
                    or checksum(page.data) != page.crc):
                self._count("bad_page")
                log.warning("kvstore %s returned a page that does not verify (key, size or CRC); ignoring it "
                            "and the pages after it", self.address)
                break
            good.append(page.data)
        if not good:
            return present, None
        flat = torch.frombuffer(bytearray(b"".join(good)), dtype=self.dtype)
        return present, flat.view(len(good), *self.page_shape)

    def write_back_room(self) -> bool:
        """Whether ``write_back`` would take one more write now (any thread: the prefill's engine thread asks
        before exporting a request's pages, so pages a full writer would drop are never copied off the device).
        Advisory: requests finishing in one step may all see room; ``write_back`` still drops the excess."""
        return self.available and len(self._bg) < self.max_pending_writes

    def write_back_skipped(self) -> None:
        """Count a write-back the engine thread skipped for want of room (``write_back_room`` was False)."""
        self._count("write_back_dropped")

    def write_back(self, hashes: list[bytes], first_block: int, pages: PageExport) -> None:
        """Put the pages of blocks [first_block, first_block + P) in the background, once their export (started
        on the engine thread) reaches the host; dropped, and counted, while the store is backing off or
        ``max_pending_writes`` are already under way."""
        if not self.write_back_room():
            self._count("write_back_dropped")
            return
        task = asyncio.create_task(self._put(hashes[first_block:], pages))
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)

    async def _put(self, hashes: list[bytes], export: PageExport) -> None:
        fp = self.layout.fingerprint

        def encode() -> list[bytes]:
            """A worker thread: wait for the device-to-host copy, then each page's CRC and its Put messages,
            serialized with the page bytes copied once from the host pages (``serialized_pieces``), so the
            process's event loop and engine thread never copy or serialize page bytes."""
            pages = export.wait()
            raw = pages.contiguous().view(torch.uint8).numpy()
            out: list[bytes] = []
            for h, row in zip(hashes[:raw.shape[0]], raw, strict=True):
                view = memoryview(row)
                out.extend(serialized_pieces(fp, h, view, checksum(view), self.client.piece_bytes))
            return out

        try:
            messages = await asyncio.to_thread(encode)
            await asyncio.wait_for(self.client.put_serialized(messages), WRITE_BACK_TIMEOUT_S)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            self._failed("put", f"write-back of {len(hashes)} pages", e)

    async def close(self) -> None:
        for t in list(self._bg):
            await asyncio.wait({t}, timeout=5.0)
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await self._channel.close()
