"""On-disk tier: one file per page, LRU by access time, a hard byte budget, survives restarts.

Layout: ``<dir>/<fp>/<hash hex[:2]>/<hash hex>.page``. A file is one page record
(:mod:`services.kvstore.page_record`: header, then payload), the same bytes the Mooncake backend stores.

Files are written under a temporary name and ``os.replace``d into place, so a crash leaves either the
old state or a whole file (a torn ``.tmp`` is deleted at the next start). The index is rebuilt at start
by reading headers only; the CRC is checked on every read. A file that is truncated, mislabelled or
fails its CRC is removed, counted in ``corrupt`` and reported as a miss: never served.

Thread-safe: the index is guarded by a lock; file I/O runs outside it, in the caller's (worker) thread.
Budget accounting counts whole files (header + payload), and a write reserves its bytes before the file
exists, so ``stats.bytes <= capacity`` holds at every instant.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from services.kvstore.backend import Key, TierStats, fingerprint_problem, key_str
from services.kvstore.page_record import (
    HEADER_SIZE,
    crc_problem,
    decode_header,
    encode_header,
    record_problem,
)

log = logging.getLogger(__name__)

PAGE_SUFFIX = ".page"
TMP_SUFFIX = ".tmp"


@dataclass
class _Entry:
    file_bytes: int
    ready: bool
    """False while the file is being written (the page is not visible yet)."""


class DiskTier:
    """Page files under ``root`` within ``capacity_bytes`` (header bytes included)."""

    def __init__(self, root: str | os.PathLike[str], capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root = Path(root)
        self.capacity = capacity_bytes
        self.stats = TierStats(name="disk", capacity_bytes=capacity_bytes)
        self._lock = threading.Lock()
        self._index: OrderedDict[Key, _Entry] = OrderedDict()  # least recently used first
        self.root.mkdir(parents=True, exist_ok=True)
        self._rebuild()

    # -- paths and index -----------------------------------------------------------------------------
    def path(self, key: Key) -> Path:
        fp, h = key
        hx = h.hex()
        return self.root / fp / hx[:2] / f"{hx}{PAGE_SUFFIX}"

    def _rebuild(self) -> None:
        """Index every valid page file (header-only reads), oldest access first; drop broken files."""
        t0 = time.monotonic()
        found: list[tuple[float, Key, int]] = []
        for fp_dir in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in fp_dir.glob("*/*"):
                if path.name.endswith(TMP_SUFFIX):
                    self._unlink(path)  # torn write from a crash
                    continue
                if not path.name.endswith(PAGE_SUFFIX):
                    continue
                parsed = self._scan_one(fp_dir.name, path)
                if parsed is None:
                    self.stats.corrupt += 1
                    log.warning("kvstore disk: dropping unreadable page file %s", path)
                    self._unlink(path)
                else:
                    found.append(parsed)
        found.sort(key=lambda t: t[0])
        for _, key, size in found:
            self._index[key] = _Entry(size, True)
            self.stats.bytes += size
        self._evict_until(0)  # the budget may have shrunk since the files were written
        self.stats.entries = len(self._index)
        log.info("kvstore disk: indexed %d pages (%d bytes) under %s in %.2fs", len(self._index),
                 self.stats.bytes, self.root, time.monotonic() - t0)

    def _scan_one(self, fp_name: str, path: Path) -> tuple[float, Key, int] | None:
        if fingerprint_problem(fp_name) is not None:
            return None
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                header = decode_header(f.read(HEADER_SIZE))
        except OSError:
            return None
        if header is None:
            return None
        key = (header.fp, header.h)
        if header.fp != fp_name or self.path(key) != path or record_problem(header, key, st.st_size) is not None:
            return None
        return max(st.st_atime, st.st_mtime), key, st.st_size

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            self.stats.errors += 1
            log.warning("kvstore disk: cannot remove %s: %s", path, e)

    def _drop(self, key: Key) -> None:
        """Remove ``key`` from the index and its file from disk. Caller holds the lock."""
        entry = self._index.pop(key, None)
        if entry is not None:
            self.stats.bytes -= entry.file_bytes
            self.stats.entries = len(self._index)
        self._unlink(self.path(key))

    def _evict_until(self, incoming: int) -> None:
        """Evict ready LRU pages until ``incoming`` more bytes fit. Caller holds the lock."""
        while self.stats.bytes + incoming > self.capacity:
            victim = next((k for k, e in self._index.items() if e.ready), None)
            if victim is None:
                break
            self._drop(victim)
            self.stats.evictions += 1

    # -- operations (call from worker threads) ----------------------------------------------------------
    def __contains__(self, key: Key) -> bool:
        with self._lock:
            entry = self._index.get(key)
            return entry is not None and entry.ready

    def fits(self, size: int) -> bool:
        return HEADER_SIZE + size <= self.capacity

    def put(self, key: Key, data: bytes, crc: int) -> bool:
        """Write a page (``crc`` already verified by the caller). False if present, too large or failed."""
        file_bytes = HEADER_SIZE + len(data)
        with self._lock:
            if key in self._index or not self.fits(len(data)):
                return False
            self._evict_until(file_bytes)
            if self.stats.bytes + file_bytes > self.capacity:
                return False  # the rest of the budget is reserved by in-flight writes
            entry = _Entry(file_bytes, False)
            self._index[key] = entry
            self.stats.bytes += file_bytes
            self.stats.entries = len(self._index)
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(encode_header(key[0], key[1], len(data), crc))
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kvstore disk: cannot write %s: %s", path, e)
            self._unlink(tmp)
            with self._lock:
                self.stats.errors += 1
                if self._index.get(key) is entry:
                    self._index.pop(key)
                    self.stats.bytes -= file_bytes
                    self.stats.entries = len(self._index)
            return False
        with self._lock:
            if self._index.get(key) is entry:
                entry.ready = True
                return True
        # Deleted while we wrote it: make sure the file does not outlive its index entry.
        self._unlink(path)
        return False

    def get(self, key: Key) -> tuple[bytes, int] | None:
        """(payload, crc32) verified, or None (absent, truncated, corrupt: the latter two are removed)."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None or not entry.ready:
                self.stats.misses += 1
                return None
            self._index.move_to_end(key)
        path = self.path(key)
        page: tuple[bytes, int] | None = None
        problem: str | None = None
        try:
            page, problem = self._read(key, path)
        except FileNotFoundError:
            pass  # removed under us (delete, eviction, an operator): a miss
        except OSError as e:
            problem = f"read failed: {e}"
        with self._lock:
            if page is not None:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
                if problem is not None:
                    self.stats.corrupt += 1
                    log.warning("kvstore disk: page %s is corrupt (%s); removed", key_str(*key), problem)
                if self._index.get(key) is entry:
                    self._drop(key)
        if page is not None:
            try:
                os.utime(path)  # LRU order across restarts
            except OSError:
                pass
        return page

    def _read(self, key: Key, path: Path) -> tuple[tuple[bytes, int] | None, str | None]:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header = decode_header(f.read(HEADER_SIZE))
            problem = record_problem(header, key, size)
            if problem is not None or header is None:
                return None, problem
            data = f.read(header.length)
        if len(data) != header.length:
            return None, f"read {len(data)} of {header.length} payload bytes"
        problem = crc_problem(data, header.crc)
        return (None, problem) if problem is not None else ((data, header.crc), None)

    def delete(self, keys: list[Key]) -> int:
        """Remove pages; returns how many were present."""
        with self._lock:
            present = [k for k in keys if k in self._index]
            for k in present:
                self._drop(k)
            return len(present)

    def delete_layout(self, fp: str) -> list[Key]:
        """Remove every page of layout ``fp``; returns their keys."""
        with self._lock:
            keys = [k for k in self._index if k[0] == fp]
            for k in keys:
                self._drop(k)
            return keys

    def snapshot(self) -> TierStats:
        with self._lock:
            return TierStats(**vars(self.stats))
