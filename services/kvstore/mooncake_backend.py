"""The Mooncake Store backend (``--backend mooncake``): pages live in a Mooncake Store cluster.

This process is a Mooncake client that also contributes ``global_segment_size`` bytes of memory to
the cluster; ``mooncake_master`` (see ``mooncake_master.py``) holds the metadata. Object key:
``<fp>/<hash hex>``. Object value: one page record (:mod:`services.kvstore.page_record`, the disk
tier's file format: a header naming the key, length and CRC-32, then the page), so a lost, evicted,
truncated or foreign value is detected and reported as a miss, never served.

Mooncake semantics mapped onto the interface:
- put never overwrites: an existing key is reported as skipped (checked with is_exist first).
- eviction is silent: a later get finds nothing, which is a miss.
- an unreachable master makes calls fail with negative codes, some only after a ~4 s reconnect attempt
  inside the client: each failure is counted in ``errors`` and surfaces as a miss or a skipped put.
  Calls are bounded by ``op_timeout_s`` (the native call is left to finish in its thread), and after
  a failure a circuit breaker fails calls fast for ``retry_after_s`` before letting one through again.
Every native call runs in a dedicated thread pool, so hung calls cannot starve ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from services.common.kv_mooncake import keep_for_process_life
from services.kvstore.backend import (
    KVStoreBackend,
    StoreStats,
    TierStats,
    key_str,
    validate_key,
    verify_checksum,
)
from services.kvstore.page_record import encode_header, parse_record

log = logging.getLogger(__name__)

TIER = "mooncake"
T = TypeVar("T")
# Return codes meaning "cannot talk to the master" (Mooncake ErrorCode RPC_FAIL = -900), plus our -1
# for a timeout or a health_check() that says so. Others (e.g. -200 no space) leave the breaker closed.
_UNREACHABLE_CODES = frozenset({-900, -1})


@dataclass(frozen=True)
class MooncakeSettings:
    """How this process joins a Mooncake Store cluster."""

    master_address: str
    """``host:port`` of mooncake_master's RPC server."""
    local_hostname: str = "127.0.0.1"
    """Address other Mooncake clients reach this one at."""
    metadata_server: str = "P2PHANDSHAKE"
    """Transfer-engine metadata service; P2PHANDSHAKE needs none (no etcd)."""
    global_segment_bytes: int = 1 << 30
    """Memory this process contributes to the cluster (bytes)."""
    local_buffer_bytes: int = 256 << 20
    """Client staging buffer for puts/gets (bytes); must exceed the largest page + header."""
    protocol: str = "tcp"
    """Transfer protocol: tcp, or rdma in a data centre."""
    device: str = ""
    """RDMA device names (empty for tcp)."""
    op_timeout_s: float = 5.0
    """Longest wait for one store call before it counts as failed (seconds)."""
    retry_after_s: float = 2.0
    """After a failure, calls fail fast for this long before one is tried again (seconds)."""
    threads: int = 8
    """Worker threads for native store calls (also the most concurrent calls)."""


class MooncakeBackend(KVStoreBackend):
    """Pages in Mooncake Store. Construct, then ``await open()``."""

    name = "mooncake"

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self._store: Any = None
        self._lock = threading.Lock()  # guards the counters and _putting (used from worker threads)
        self._stats = TierStats(name=TIER, capacity_bytes=settings.global_segment_bytes)
        self._putting: set[str] = set()  # keys with a put in flight in this process
        self._open_until = 0.0  # circuit breaker: fail fast until this monotonic time
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.threads, thread_name_prefix="mooncake")

    async def open(self) -> MooncakeBackend:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._setup)
        return self

    def _setup(self) -> None:
        # Mooncake's native transfer engine takes its bind address only from the environment, at setup:
        # bind to our own address (loopback for a local cluster) unless the operator set it.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1" if _is_loopback(self.settings.local_hostname)
                              else self.settings.local_hostname)
        from mooncake.store import MooncakeDistributedStore

        s = self.settings
        store = MooncakeDistributedStore()
        keep_for_process_life(store)
        rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_bytes, s.local_buffer_bytes,
                         s.protocol, s.device, s.master_address)
        if rc != 0:
            raise ConnectionError(f"Mooncake Store setup failed (rc={rc}) with master {s.master_address}, "
                                  f"metadata {s.metadata_server}, protocol {s.protocol}")
        self._store = store
        log.info("kvstore: joined Mooncake Store at %s (segment %d bytes)", s.master_address,
                 s.global_segment_bytes)

    async def close(self, timeout_s: float = 3.0) -> None:
        """Leave the cluster (unmounts our segment), waiting at most ``timeout_s``.

        The native close cannot be bounded from Python: with the master gone it retries the unmount for
        ~10 s (longer where the master's address no longer answers at all, as when its pod is deleted
        beside ours) holding the GIL, so the whole process, its shutdown included, stalls. So the
        master is dialled first: when it does not answer within ``timeout_s`` / 3 the native close is
        skipped (the master drops a segment whose client stops pinging it; the OS reclaims the memory)."""
        store, self._store = self._store, None
        if store is not None:
            if not await self._master_answers(timeout_s / 3):
                log.warning("kvstore mooncake: master %s does not answer; leaving without unmounting "
                            "(the master drops this segment when its client stops pinging)",
                            self.settings.master_address)
            else:
                fut = asyncio.get_running_loop().run_in_executor(self._pool, store.close)
                try:
                    await asyncio.wait_for(fut, timeout_s)
                except TimeoutError:
                    log.warning("kvstore mooncake: client close still running after %.1fs (master gone?); "
                                "not waiting", timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _master_answers(self, timeout_s: float) -> bool:
        """Whether mooncake_master's RPC port accepts a TCP connection within ``timeout_s``."""
        host, _, port = self.settings.master_address.rpartition(":")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
        except (OSError, ValueError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True

    async def _call(self, fn: Callable[..., T], *args: Any, on_fail: T, miss: bool = False) -> T:
        """Run ``fn`` in the pool, bounded by op_timeout_s. ``on_fail`` (counted as an error, and as a
        miss when ``miss``) when the breaker is open or the call times out."""
        if self._store is None or time.monotonic() < self._open_until:
            self._count(errors=1, misses=int(miss))
            return on_fail
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(fut, self.settings.op_timeout_s)
        except TimeoutError:
            self._failed(f"{fn.__name__} (no answer within {self.settings.op_timeout_s:.1f}s)", -1)
            self._count(misses=int(miss))
            return on_fail

    # -- helpers (worker threads) ---------------------------------------------------------------------
    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                setattr(self._stats, k, getattr(self._stats, k) + v)

    def _available(self) -> bool:
        """False (fast) while the breaker is open or the client knows the master is unreachable."""
        if self._store is None or time.monotonic() < self._open_until:
            return False
        return bool(self._store.health_check() == 0)

    def _failed(self, what: str, rc: int) -> None:
        """Count a failure; open the breaker when it looks like the master/network (not a full store)."""
        self._count(errors=1)
        if rc in _UNREACHABLE_CODES:
            self._open_until = time.monotonic() + self.settings.retry_after_s
            log.warning("kvstore mooncake: %s failed (rc=%s); failing fast for %.1fs", what, rc,
                        self.settings.retry_after_s)
        else:
            log.warning("kvstore mooncake: %s failed (rc=%s)", what, rc)

    def _locate(self, fp: str, hashes: Sequence[bytes]) -> list[str]:
        if not hashes or not self._available():
            return []
        found = self._store.batch_is_exist([key_str(fp, h) for h in hashes])
        tiers: list[str] = []
        for rc in found:
            if rc != 1:
                if rc < 0:
                    self._failed("batch_is_exist", rc)
                break
            tiers.append(TIER)
        return tiers

    def _get(self, fp: str, h: bytes) -> tuple[bytes, int] | None:
        if not self._available():
            self._count(misses=1, errors=1)
            return None
        key = key_str(fp, h)
        value = self._store.get(key)
        if not value:
            # Absent, evicted or the master is gone: all misses. Tell the last apart for the counters.
            if self._store.health_check() != 0:
                self._failed("get", -1)
            self._count(misses=1)
            return None
        page, problem = parse_record(value, (fp, h))
        if page is None:
            log.warning("kvstore mooncake: value of %s is corrupt (%s); removed", key, problem)
            self._store.remove(key, True)
            self._count(misses=1, corrupt=1)
            return None
        self._count(hits=1)
        return page

    def _put(self, fp: str, h: bytes, data: bytes, crc: int) -> bool:
        if not self._available():
            self._count(errors=1)
            return False
        key = key_str(fp, h)
        # Mooncake's put of an existing key also returns 0, so "stored" rests on is_exist first; keys
        # being put by this process are claimed so concurrent duplicates here report skipped.
        with self._lock:
            if key in self._putting:
                return False
            self._putting.add(key)
        try:
            exists = self._store.is_exist(key)
            if exists == 1:
                return False
            if exists < 0:
                self._failed("is_exist", exists)
                return False
            rc = self._store.put_parts(key, encode_header(fp, h, len(data), crc), data)
            if rc != 0:
                self._failed(f"put of {key} ({len(data)} bytes)", rc)
                return False
            return True
        finally:
            with self._lock:
                self._putting.discard(key)

    def _delete(self, fp: str, hashes: Sequence[bytes]) -> int:
        if not hashes or not self._available():
            return 0
        rcs = self._store.batch_remove([key_str(fp, h) for h in hashes], True)
        return sum(1 for rc in rcs if rc == 0)

    def _delete_layout(self, fp: str) -> int:
        if not self._available():
            return 0
        rc = self._store.remove_by_regex(f"^{fp}/", True)
        if rc < 0:
            self._failed("remove_by_regex", rc)
            return 0
        return int(rc)

    # -- interface ------------------------------------------------------------------------------------
    async def locate(self, fp: str, hashes: Sequence[bytes]) -> list[str]:
        validate_key(fp, hashes)
        return await self._call(self._locate, fp, list(hashes), on_fail=[])

    async def get(self, fp: str, h: bytes) -> bytes | None:
        page = await self.get_page(fp, h)
        return page[0] if page is not None else None

    async def get_page(self, fp: str, h: bytes) -> tuple[bytes, int] | None:
        validate_key(fp, h)
        return await self._call(self._get, fp, h, on_fail=None, miss=True)

    async def put(self, fp: str, h: bytes, data: bytes, crc: int) -> bool:
        validate_key(fp, h)
        await asyncio.to_thread(verify_checksum, fp, h, data, crc)
        return await self._call(self._put, fp, h, data, crc, on_fail=False)

    async def delete(self, fp: str, hashes: Sequence[bytes]) -> int:
        validate_key(fp, hashes)
        return await self._call(self._delete, fp, list(hashes), on_fail=0)

    async def delete_layout(self, fp: str) -> int:
        validate_key(fp, [])
        return await self._call(self._delete_layout, fp, on_fail=0)

    def stats(self) -> StoreStats:
        """``bytes``/``entries`` stay 0 (unknown: the cluster evicts silently); capacity is our segment."""
        with self._lock:
            return StoreStats(backend=self.name, tiers=[TierStats(**vars(self._stats))])


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1")
