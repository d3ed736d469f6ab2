"""Prefill's use of the kvstore: load prefix pages other instances computed, write new ones back.

Lookups and loads happen before the request is admitted (only when the store holds more leading
blocks than the local prefix cache), in this process. Write-back runs in the background after the
handoff, so the first token never waits for it, and its data path is out of this process: the engine
thread exports the pages into a shared-memory ring and a writer process puts them
(kvstore_writeback.py, kvstore_writer.py). Any kvstore failure is a miss, logged and counted, never an
error for the request. After a failure the store is skipped for ``retry_s`` (no request waits on a dead
store), then tried again: the channel reconnects on its own (backoff capped at a few seconds), so
reuse resumes once the store is back; a Put that found the store unreachable backs off the same way.

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
from services.common.tls import TLSConfig
from services.engine.kv_layout import PageLayout
from services.engine.kv_pages import PageExport
from services.prefill.kvstore_writeback import KVStoreWriter, WriteBackSpan
from services.prefill.kvstore_writer import RECONNECT_BACKOFF_MS
from services.prefill.writeback_ring import RingError

log = logging.getLogger(__name__)

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
    writer: KVStoreWriter | None = field(default=None, init=False)
    """The write-back's ring and writer process (``start_writer``); None: no write-back."""
    _down_until: float = field(default=0.0, init=False, repr=False)
    """time.monotonic() before which the store is not asked."""

    def __post_init__(self, tls: TLSConfig | None) -> None:
        self._tls = tls
        first, longest = RECONNECT_BACKOFF_MS
        self._channel = create_channel(self.address, tls=tls, options=[
            ("grpc.initial_reconnect_backoff_ms", first), ("grpc.min_reconnect_backoff_ms", first),
            ("grpc.max_reconnect_backoff_ms", longest)])
        self.client = KVStoreClient(self._channel, max_page_bytes=self.layout.page_bytes)

    def hashes(self, ids: list[int]) -> list[bytes]:
        return block_hashes(ids, self.layout.block_size)

    def _failed(self, reason: str, what: str, err: BaseException) -> None:
        """Count a failure; one that says the store is unreachable or stuck also backs off ``retry_s``."""
        unreachable = isinstance(err, TimeoutError) or (
            isinstance(err, grpc.aio.AioRpcError) and err.code() in _UNREACHABLE)
        self._failure(reason, what, rpc_error_summary(err), unreachable)

    def _failure(self, reason: str, what: str, summary: str, unreachable: bool) -> None:
        self.failures += 1
        self._count(reason)
        if unreachable:
            self._down_until = time.monotonic() + self.retry_s
        log.warning("kvstore %s: %s failed (%s)%s", self.address, what, summary,
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

    def start_writer(self, export: Callable[[list[int], torch.Tensor], PageExport], device: torch.device,
                     ring_bytes: int) -> bool:
        """Make the write-back ring (``ring_bytes``) and start the writer process (event loop); False, logged, when
        the ring cannot be made (write-back is then off). ``export(block_ids, out)``: the engine's page export
        in the cache's own layout into ``out``."""
        try:
            self.writer = KVStoreWriter(
                address=self.address, tls=self._tls, fingerprint=self.layout.fingerprint,
                page_bytes=self.layout.page_bytes, page_shape=self.page_shape, dtype=self.dtype, device=device,
                ring_bytes=ring_bytes, max_pending_writes=self.max_pending_writes, export=export,
                on_skip=self._count, on_put_failed=self._put_failed)
        except RingError as e:
            log.error("kvstore write-back is off: %s", e)
            return False
        self.writer.start()
        return True

    @property
    def writes_back(self) -> bool:
        """Whether new pages may go to the store now: a writer exists and the store is not backing off."""
        return self.writer is not None and self.available

    def _put_failed(self, status: str, detail: str) -> None:
        """The writer process's Put failed: ``unreachable`` (no answer, or a timeout) backs off like a failed
        Lookup; ``refused`` (any other error) is counted only."""
        self._failure("put", "Put", detail, status == "unreachable")

    def write_back_begin(self, block_ids: list[int]) -> WriteBackSpan | str:
        """Engine thread: take a ring span for the pages of ``block_ids`` and start their export into it; else the
        reason the write-back is skipped (counted by ``write_back_skipped``), so pages a full ring or a missing
        writer would drop are never copied off the device. Never waits."""
        if self.writer is None or not self.available:
            return "write_back_dropped"
        return self.writer.begin(block_ids)

    def write_back_skipped(self, reason: str) -> None:
        """Count a write-back ``write_back_begin`` skipped (``write_back_dropped``: no span or too many under way;
        ``writer``: the writer process is down)."""
        self._count(reason)

    def write_back(self, hashes: list[bytes], first_block: int, span: WriteBackSpan) -> None:
        """Put the span's pages (blocks [first_block, first_block + P)) in the background through the writer
        process; dropped, and counted, while the store is backing off."""
        assert self.writer is not None
        if not self.available:
            self.writer.abandon(span)
            self._count("write_back_dropped")
            return
        self.writer.submit(hashes[first_block:first_block + span.pages], span)

    def write_back_abandon(self, span: WriteBackSpan) -> None:
        """The request ended without a handoff: its span goes back once its export landed, unwritten."""
        if self.writer is not None:
            self.writer.abandon(span)

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        await self._channel.close()
