"""Core lending between the engine processes of one host.

``pdserve up`` gives each engine process a share of the host's cores (cpu_features.split_cores). At low
load the engines are rarely busy at the same time (while a prefill computes, its decode waits for the KV;
while the decode decodes, the prefill is idle), so a fixed split leaves half the host idle. Engines that
name the same share group lend each other their shares: before each step an engine runs with its own
share plus the shares of the peers that are idle, and drops back to its own share when it has no work.

The group is a small fixed-layout file, ``/dev/shm/pdserve-cores-<id>`` (mode 0600, owned by this user),
with one slot per process. Each process writes its own slot only (claimed under an flock); every field is
one aligned 8-byte word, so a reader sees each field whole (a slot read while it changes is at worst one
step out of date)::

    header  [magic, slots]                               2 x int64
    slot i  [pid, share (threads), threads (now), state] 4 x int64
            state = last change (CLOCK_MONOTONIC ns, one clock for all processes) << 1 | busy

Invariants: an engine uses its own share whenever it works, so when every engine works the threads add up
to the shares given (the cores, or more where ``pdserve up`` widened a one-thread prefill over the decodes'
cores: cpu_features.widen_prefills); no engine runs more threads than the host's CPUs (``max_threads``,
however much is lendable); a busy peer is never borrowed from, and what working peers borrowed
already is not lent twice (two borrowers reading at the same instant may still both take it, until their
next steps); a peer is lent from only once it has been idle for ``HOLD_NS`` (or its pid is gone: a crashed
peer's stale slot counts as idle), so a peer that pauses for less than that is never borrowed from and
thread counts change at most once per peer pause (no flapping). torch's thread count is set only when it
changes.

No torch import here: the caller passes the function that sets the thread count.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
FILE_PREFIX = "pdserve-cores-"
MAGIC = 0x5044434F52455331
"""First word of a share-group file (b"PDCORES1" read as a big-endian int64)."""
SLOTS = 16
"""Engine processes one group holds."""
_SLOT_WORDS = 4
_HEADER_WORDS = 2
FILE_WORDS = _HEADER_WORDS + SLOTS * _SLOT_WORDS
FILE_BYTES = FILE_WORDS * 8
HOLD_NS = 3_000_000
"""A peer is lent from only once it has been idle this long (ns): shorter pauses (between two steps, a
command on its engine thread) never move threads."""
_GROUP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class CoreShareError(ValueError):
    pass


def check_group_id(group: str) -> str:
    """``group`` if it is a valid share-group id (letters, digits, ``_.-``; no path separators), else
    CoreShareError."""
    if not _GROUP_ID.fullmatch(group):
        raise CoreShareError(f"{group!r} is not a share-group id (1-64 of A-Z a-z 0-9 _ . -, starting with a "
                             "letter or digit)")
    return group


def group_path(group: str, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / f"{FILE_PREFIX}{check_group_id(group)}"


@dataclass(frozen=True)
class Peer:
    """One slot as read: ``changed_ns`` on CLOCK_MONOTONIC."""

    pid: int
    share: int
    threads: int
    busy: bool
    changed_ns: int


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def lendable_threads(peers: Iterable[Peer], now_ns: int, hold_ns: int = HOLD_NS,
                     alive: Callable[[int], bool] = pid_alive) -> int:
    """Threads the caller may borrow now: the shares of peers idle for at least ``hold_ns`` or gone, less
    what the other live working peers (busy, or paused shorter than the hold) borrowed already (their
    published threads above their share), so the borrowed threads never add up to more than the idle
    shares."""
    idle_shares = borrowed = 0
    for p in peers:
        if p.pid <= 0 or p.share <= 0:
            continue
        idle_long = not p.busy and now_ns - p.changed_ns >= hold_ns
        if idle_long or not alive(p.pid):  # liveness is asked only of peers that look busy or just paused
            idle_shares += p.share
        else:
            borrowed += max(0, p.threads - p.share)
    return max(0, idle_shares - borrowed)


def _open_group(path: Path, create_only: bool) -> int:
    """fd of the group file, created 0600 if absent (``create_only``: must not exist yet); refused
    (CoreShareError) unless it is a regular file of this user that nobody else may open."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | (os.O_EXCL if create_only else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CoreShareError(f"{path} is a symbolic link: refused") from None
        raise CoreShareError(f"cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        os.close(fd)
        raise CoreShareError(f"{path} is not a regular file of this user with mode 0600: refused")
    return fd


def _map(fd: int) -> mmap.mmap:
    """Map the group file, writing its header first if the file is new (the caller holds the flock)."""
    size = os.fstat(fd).st_size
    if size == 0:
        os.ftruncate(fd, FILE_BYTES)
    elif size != FILE_BYTES:
        raise CoreShareError(f"share-group file has {size} bytes, expected {FILE_BYTES}: refused")
    mm = mmap.mmap(fd, FILE_BYTES)
    words = (ctypes.c_int64 * FILE_WORDS).from_buffer(mm)
    try:
        if size == 0:
            words[1] = SLOTS
            words[0] = MAGIC
        elif words[0] != MAGIC or words[1] != SLOTS:
            raise CoreShareError("share-group file has another layout: refused")
    finally:
        del words
    return mm


def create_group(group: str, shm_dir: Path = SHM_DIR) -> Path:
    """Create a fresh, empty share group (``pdserve up`` before it starts its engines); CoreShareError if
    the file exists already."""
    path = group_path(group, shm_dir)
    fd = _open_group(path, create_only=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        _map(fd).close()
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return path


def remove_group(group: str, shm_dir: Path = SHM_DIR) -> None:
    """Remove a group's file (``pdserve up`` at exit); nothing if it is gone already."""
    try:
        group_path(group, shm_dir).unlink()
    except FileNotFoundError:
        pass


def _claim(mm: mmap.mmap, pid: int, share: int) -> int | None:
    """Claim a slot for ``pid`` (the caller holds the flock): its own again, else an empty one or one whose
    process is gone; None if every slot is live."""
    words = (ctypes.c_int64 * FILE_WORDS).from_buffer(mm)
    try:
        pids = [words[_HEADER_WORDS + i * _SLOT_WORDS] for i in range(SLOTS)]
        slot = next((i for i, p in enumerate(pids) if p == pid), None)
        if slot is None:
            slot = next((i for i, p in enumerate(pids) if p <= 0 or not pid_alive(p)), None)
        if slot is not None:
            base = _HEADER_WORDS + slot * _SLOT_WORDS
            words[base + 1] = share
            words[base + 2] = share
            words[base + 3] = time.monotonic_ns() << 1  # idle since now: not lendable for HOLD_NS
            words[base] = pid
        return slot
    finally:
        del words  # the mapping can be closed only once no ctypes view of it is left


class CoreShare:
    """This process's slot in a share group; :meth:`busy` before each step, :meth:`idle` when out of work.

    Used by one thread (the engine loop); :meth:`peers` reads every slot."""

    def __init__(self, mm: mmap.mmap, slot: int, share: int, set_threads: Callable[[int], None],
                 hold_ns: int = HOLD_NS, pid: int | None = None, max_threads: int = 0) -> None:
        self._mm = mm
        self.max_threads = max_threads
        """Most threads a step runs with, borrowed ones included (the host's CPUs; 0: no bound)."""
        self._words = (ctypes.c_int64 * FILE_WORDS).from_buffer(mm)
        self.slot, self.share, self.hold_ns = slot, share, hold_ns
        self.pid = pid if pid is not None else os.getpid()
        self._set_threads = set_threads
        self.threads = share
        """Threads this process runs with now."""
        self._busy: bool | None = None
        self._since = 0
        """CLOCK_MONOTONIC ns of this process's last busy/idle change."""
        self.changes = 0
        """Times the thread count changed (tests; flapping would show here)."""

    @classmethod
    def join(cls, group: str, share: int, set_threads: Callable[[int], None], *, hold_ns: int = HOLD_NS,
             shm_dir: Path = SHM_DIR, pid: int | None = None, max_threads: int = 0) -> CoreShare:
        """Claim a slot of ``group`` (creating its file if absent): this pid's own slot again, else an
        empty one or one whose process is gone. CoreShareError when the file is refused or full.
        ``max_threads``: the most threads a step may run with (0: no bound)."""
        if share < 1:
            raise CoreShareError(f"share must be >= 1 thread, got {share}")
        me = pid if pid is not None else os.getpid()
        fd = _open_group(group_path(group, shm_dir), create_only=False)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            mm = _map(fd)
            try:
                slot = _claim(mm, me, share)
            except BaseException:
                mm.close()
                raise
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: the mapping holds a dup of fd (the lock's owner)
            os.close(fd)
        if slot is None:
            mm.close()
            raise CoreShareError(f"share group {group!r} is full ({SLOTS} live processes)")
        log.info("core share group %s: slot %d, own share %d thread(s)", group, slot, share)
        return cls(mm, slot, share, set_threads, hold_ns, me, max_threads)

    def _base(self, slot: int) -> int:
        return _HEADER_WORDS + slot * _SLOT_WORDS

    def peers(self) -> list[Peer]:
        """Every other claimed slot, as read now."""
        out = []
        w = self._words
        for i in range(SLOTS):
            if i == self.slot:
                continue
            b = self._base(i)
            pid = w[b]
            if pid > 0:
                state = w[b + 3]
                out.append(Peer(pid, w[b + 1], w[b + 2], bool(state & 1), state >> 1))
        return out

    def _mark(self, busy: bool, now_ns: int) -> None:
        if self._busy is not busy:
            self._busy, self._since = busy, now_ns
            self._words[self._base(self.slot) + 3] = (now_ns << 1) | int(busy)

    def _apply(self, threads: int) -> int:
        if threads != self.threads:
            self._set_threads(threads)
            self.threads = threads
            self.changes += 1
            self._words[self._base(self.slot) + 2] = threads
            log.debug("core share: %d thread(s)", threads)
        return threads

    def busy(self, now_ns: int | None = None, borrow: bool = True, exactly: int = 0) -> int:
        """Mark this process busy and run with its share plus what idle peers lend (``borrow=False``: its own
        share only; ``exactly`` > 0: borrowed only when that makes exactly this many, else its own share);
        the thread count."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        self._mark(True, now)
        total = self.share + (lendable_threads(self.peers(), now, self.hold_ns) if borrow else 0)
        if self.max_threads:
            total = max(self.share, min(total, self.max_threads))
        return self._apply(total if not exactly or total == exactly else self.share)

    def idle(self, now_ns: int | None = None) -> int:
        """Mark this process idle (lendable once ``hold_ns`` has passed); once it has been idle that long,
        drop back to its own share (a shorter pause keeps the count: no flapping between steps)."""
        now = time.monotonic_ns() if now_ns is None else now_ns
        self._mark(False, now)
        if now - self._since >= self.hold_ns:
            self._apply(self.share)
        return self.threads

    def leave(self) -> None:
        """Free the slot and unmap the file (shutdown)."""
        b = self._base(self.slot)
        if self._words[b] == self.pid:
            self._words[b] = 0
        del self._words
        self._mm.close()
