"""The prefill's side of the kvstore write-back: a shared-memory ring and the writer process that puts its pages.

A finished prompt's new full pages go to the kvstore without their bytes ever passing through this process's
interpreter:

* **Ring** (writeback_ring.py): one shared-memory file per prefill (``--kvstore-write-back-bytes``; default 1 GiB
  on CUDA, 256 MiB on CPU: config.KVSTORE_WRITE_BACK_BYTES), unlinked at once, mapped here and in the writer
  (which gets the descriptor), page-locked on CUDA; spans handed out first-fit, never waited for.
* **Engine thread** (``begin``): takes a span (no span, or ``--kvstore-max-pending-writes`` writes already under
  way: the write-back is dropped, counted as ``write_back_dropped``; the writer down: counted as ``writer``) and
  starts the page export into it (KVPages.export with ``out``: a gather on CPU, the side streams' gather and
  copy on GPU). Nothing else; it never waits.
* **Event loop** (``submit``, after the request's handoff): a task waits for the export in a worker thread, sends
  the writer a PUT naming the span (offset, pages, page size, the pages' block hashes: a few hundred bytes)
  and gives the span back on the writer's DONE, or once the writer process has exited.
* **Writer process** (kvstore_writer.py): reads the pages from the ring, CRCs, serializes and Puts them on its
  own grpc.aio channel, then answers DONE.

Failure: the writer exiting (its channel closes) or not answering (no PONG to the pings sent every
``HEALTH_EVERY_S`` within ``HEALTH_TIMEOUT_S``, or a PUT unanswered past the Put timeout and a grace) is logged
once, the process is killed and reaped, the writes it held are given back and counted (``writer``), as is every
write-back meanwhile, and a new writer starts after a backoff (``RESTART_BACKOFF_S``, doubling, reset once one
stayed up ``HEALTHY_S``). No request waits on any of it. A Put the kvstore refused or that timed out comes back
in DONE and is counted as ``put`` (an unreachable store also backs the prefill's kvstore use off, as a failed
Lookup does).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.logging import current_config
from services.common.tls import TLSConfig
from services.engine.kv_pages import PageExport
from services.prefill import kvstore_writer as wire
from services.prefill.writeback_ring import SHM_DIR, ShmRing

log = logging.getLogger(__name__)

HEALTH_EVERY_S = 1.0
"""The writer is pinged this often (seconds)."""
HEALTH_TIMEOUT_S = 10.0
"""A writer that answered nothing (PONG or DONE) for this long is stuck: killed and restarted (seconds)."""
ANSWER_GRACE_S = 30.0
"""A PUT unanswered this long past the writer's own Put timeout marks the writer stuck (seconds)."""
START_TIMEOUT_S = 30.0
"""Longest a new writer may take to say HELLO (seconds); write-backs taken meanwhile wait for it that long."""
RESTART_BACKOFF_S = (0.5, 30.0)
"""(first, longest) wait before starting a writer again after one died (seconds; doubles while they keep dying)."""
HEALTHY_S = 60.0
"""A writer that stayed up this long resets the restart backoff (seconds)."""
STOP_WAIT_S = 10.0
"""Shutdown: how long the writer may take to finish its Puts and exit after STOP before it is killed (seconds)."""
CLOSE_WAIT_S = 5.0
"""Shutdown: how long write-backs under way may take before they are abandoned (seconds)."""


@dataclass(eq=False)
class WriteBackSpan:
    """One write-back's pages in the ring: taken and exported on the engine thread, given back once the writer
    answered (or exited)."""

    off: int
    pages: int
    nbytes: int
    out: torch.Tensor
    """The span as the page export's ``out``: [pages, *page shape] of the pages' dtype."""
    export: PageExport | None = None
    handed: bool = False
    """Submitted or abandoned: a task gives the span back."""


@dataclass(eq=False)
class _Child:
    proc: subprocess.Popen
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    answered: float = field(default_factory=time.monotonic)
    """When it last sent anything (monotonic)."""
    pending: dict[int, tuple[asyncio.Future, float]] = field(default_factory=dict)
    """PUT id -> (future of (status, detail), when sent)."""
    pings: int = 0

    def send(self, body: list[Any] | dict[str, Any]) -> None:
        self.writer.write(wire.encode(body))


class WriterStartError(RuntimeError):
    """A writer process did not come up (its own line, or why not)."""


class KVStoreWriter:
    """The ring and the writer process of one prefill (module docstring).

    ``export(block_ids, out)`` is the engine's page export into ``out`` (KVPages.export in the cache's own
    layout); ``on_skip(reason)`` counts a write-back that did not happen (``write_back_dropped``, ``writer``);
    ``on_put_failed(status, detail)`` is told of a Put the kvstore refused (``refused``) or did not answer
    (``unreachable``)."""

    def __init__(self, *, address: str, tls: TLSConfig | None, fingerprint: str, page_bytes: int,
                 page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, ring_bytes: int,
                 max_pending_writes: int, export: Callable[[list[int], torch.Tensor], PageExport],
                 on_skip: Callable[[str], None], on_put_failed: Callable[[str, str], None],
                 put_timeout_s: float = wire.WRITE_BACK_TIMEOUT_S, shm_dir: str = SHM_DIR) -> None:
        self.address = address
        self.tls = tls if tls is not None and tls.tls_enabled else None
        self.fingerprint = fingerprint
        self.page_bytes = page_bytes
        self.page_shape, self.dtype = page_shape, dtype
        self.max_pending_writes = max_pending_writes
        self.export = export
        self.on_skip, self.on_put_failed = on_skip, on_put_failed
        self.put_timeout_s = put_timeout_s
        self.ring = ShmRing(ring_bytes, device, shm_dir)
        self.state = "starting"
        """starting (a writer is coming up: write-backs wait for it), up, down (none: write-backs are skipped),
        closed. Read on the engine thread."""
        self.restarts = 0
        self.pid: int | None = None
        """The writer process's pid while it is up."""
        self._child: _Child | None = None
        self._lock = threading.Lock()
        self._pending = 0
        """Spans out (taken and not yet given back); at most max_pending_writes."""
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._too_large_logged = False
        self._closing = False
        self._supervisor: asyncio.Task | None = None
        self._changed = asyncio.Event()
        """Set (and replaced) at every state change (event loop)."""

    def start(self) -> None:
        """Start the writer (and restart it whenever it dies) in the background; write-backs wait for it."""
        self._supervisor = asyncio.ensure_future(self._supervise())

    async def wait_up(self, timeout_s: float = START_TIMEOUT_S) -> bool:
        """Whether a writer is up (waiting while one starts, at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.state == "starting":
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                break
        return self.state == "up"

    def _set_state(self, state: str) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    # --- engine thread ---

    def begin(self, block_ids: list[int]) -> WriteBackSpan | str:
        """Take a span for the pages of ``block_ids`` and start their export into it; else the reason the write-back
        is skipped (a pdserve_prefill_kvstore_errors_total reason). Never waits."""
        if self.state not in ("starting", "up"):
            return "writer"
        n = len(block_ids)
        nbytes = n * self.page_bytes
        with self._lock:
            if self._pending >= self.max_pending_writes:
                return "write_back_dropped"
            off = self.ring.try_take(nbytes)
            if off is None:
                if nbytes > self.ring.capacity and not self._too_large_logged:
                    self._too_large_logged = True
                    log.warning("a kvstore write-back of %d pages (%d bytes) is larger than the write-back ring "
                                "(%d bytes): such write-backs are dropped; raise --kvstore-write-back-bytes", n,
                                nbytes, self.ring.capacity)
                return "write_back_dropped"
            self._pending += 1
        span = WriteBackSpan(off, n, nbytes, self.ring.view(off, (n, *self.page_shape), self.dtype))
        try:
            span.export = self.export(block_ids, span.out)
        except BaseException:
            self._give(span)
            raise
        return span

    # --- event loop ---

    def submit(self, hashes: list[bytes], span: WriteBackSpan) -> None:
        """Put the span's pages under ``hashes`` (one per page) in the background; the span goes back after."""
        if span.handed:
            return
        if len(hashes) != span.pages:  # never expected: the pages are not written rather than mislabelled
            log.error("kvstore write-back of %d pages named %d block hashes; not written", span.pages, len(hashes))
            self.abandon(span)
            return
        span.handed = True
        self._spawn(self._write(hashes, span))

    def abandon(self, span: WriteBackSpan) -> None:
        """The span's pages will not be written (the request failed): give it back once its export landed."""
        if span.handed:
            return
        span.handed = True
        self._spawn(self._release(span))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _give(self, span: WriteBackSpan) -> None:
        self.ring.give(span.off, span.nbytes)
        with self._lock:
            self._pending -= 1

    async def _landed(self, span: WriteBackSpan, count: bool = True) -> bool:
        """Wait (a worker thread, while a device copy is in flight) until the span holds the pages; False when the
        copy failed (counted as a failed Put when ``count``)."""
        export = span.export
        assert export is not None
        if export.done is None and export.host.data_ptr() == span.out.data_ptr():
            return True  # a CPU export gathered straight into the span

        def wait() -> None:
            host = export.wait()
            if host.data_ptr() != span.out.data_ptr():  # an export that could not take ``out`` (all TP ranks' heads)
                span.out.copy_(host.view(span.out.shape))

        try:
            await asyncio.to_thread(wait)
        except Exception as e:  # the device failed the copy: the span holds nothing usable
            if count:
                self.on_put_failed("refused", f"write-back of {span.pages} pages: the page export failed ({e!r})")
            else:
                log.warning("kvstore write-back: the page export failed (%r)", e)
            return False
        return True

    async def _release(self, span: WriteBackSpan) -> None:
        await self._landed(span, count=False)
        self._give(span)

    async def _write(self, hashes: list[bytes], span: WriteBackSpan) -> None:
        if not await self._landed(span):
            self._give(span)
            return
        child = self._child if await self.wait_up() else None
        if child is None:
            self.on_skip("writer")
            self._give(span)
            return
        wid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        child.pending[wid] = (fut, time.monotonic())
        try:
            child.send([wire.PUT, wid, span.off, span.pages, self.page_bytes, hashes])
        except (ConnectionError, RuntimeError):  # the writer just went: its reaping answers the future
            pass
        status, detail = await fut  # cancelled only at shutdown: then the span stays out (the ring is closing)
        self._give(span)
        if status == "writer":
            self.on_skip("writer")
        elif status != "ok":
            self.on_put_failed(status, f"write-back of {span.pages} pages: {detail}")

    # --- the writer process ---

    def _config(self) -> list[Any]:
        lcfg = current_config()
        tls = self.tls
        return [wire.CONFIG, {
            "address": self.address, "fingerprint": self.fingerprint, "page_bytes": self.page_bytes,
            "ring_bytes": self.ring.capacity, "timeout_s": self.put_timeout_s,
            "tls_cert": tls.tls_cert if tls else "", "tls_key": tls.tls_key if tls else "",
            "tls_ca": tls.tls_ca if tls else "", "tls_server_name": tls.tls_server_name if tls else "",
            "service": "prefill-kvstore-writer",
            "log_level": lcfg.log_level if lcfg else logging.getLevelName(logging.getLogger().level),
            "log_format": lcfg.log_format if lcfg else "text"}]

    async def _spawn_child(self) -> _Child:
        front, back = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        proc: subprocess.Popen | None = None
        try:
            try:
                proc = await asyncio.to_thread(
                    subprocess.Popen, [sys.executable, "-m", "services.prefill.kvstore_writer", str(back.fileno()),
                                       str(self.ring.fd)],
                    pass_fds=(back.fileno(), self.ring.fd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            finally:
                back.close()
            reader, writer = await asyncio.open_unix_connection(sock=front, limit=wire.MAX_FRAME + wire.HEADER.size)
            child = _Child(proc, reader, writer)
            child.send(self._config())
            try:
                msg = await asyncio.wait_for(wire.read_frame(reader), START_TIMEOUT_S)
            except TimeoutError:
                raise WriterStartError(f"no HELLO within {START_TIMEOUT_S:.0f} s") from None
            if msg is None:
                raise WriterStartError(f"it exited before it was up (status {await asyncio.to_thread(proc.wait)})")
            if isinstance(msg, list) and msg and msg[0] == wire.FATAL:
                raise WriterStartError(str(msg[1]))
            if not (isinstance(msg, list) and msg and msg[0] == wire.HELLO):
                raise WriterStartError("its first frame was not HELLO")
            return child
        except BaseException:
            front.close()
            if proc is not None:
                await asyncio.shield(asyncio.to_thread(_kill, proc))
            raise

    async def _supervise(self) -> None:
        backoff = RESTART_BACKOFF_S[0]
        while not self._closing:
            self._set_state("starting")
            began = time.monotonic()
            try:
                child = await self._spawn_child()
            except (WriterStartError, OSError, wire.WireError) as e:
                why = f"could not start: {e}"
            else:
                self._child, self.pid = child, child.proc.pid
                self._set_state("up")
                log.info("kvstore writer up (pid %d%s)", child.proc.pid,
                         f", restart {self.restarts}" if self.restarts else "")
                why = await self._watch(child)
                self._set_state("down")
                self._child = self.pid = None
                status = await self._reap(child, why)
                why = f"(pid {child.proc.pid}) {why} (exit status {status})"
            self._set_state("down")
            if time.monotonic() - began >= HEALTHY_S:
                backoff = RESTART_BACKOFF_S[0]
            log.warning("kvstore writer %s: write-backs are skipped (counted as reason writer) until it is back; "
                        "starting it again in %.1f s", why, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, RESTART_BACKOFF_S[1])
            self.restarts += 1

    async def _watch(self, child: _Child) -> str:
        """Until the writer ends or stops answering: why."""
        reader = asyncio.ensure_future(self._read(child))
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=HEALTH_EVERY_S)
                if done:
                    return reader.result()
                now = time.monotonic()
                if now - child.answered > HEALTH_TIMEOUT_S:
                    return f"stopped answering (nothing for {now - child.answered:.0f} s)"
                oldest = min((sent for _, sent in child.pending.values()), default=now)
                if now - oldest > self.put_timeout_s + ANSWER_GRACE_S:
                    return f"left a write-back unanswered for {now - oldest:.0f} s"
                child.pings += 1
                with contextlib.suppress(ConnectionError, RuntimeError):
                    child.send([wire.PING, child.pings])
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, child: _Child) -> str:
        while True:
            try:
                msg = await wire.read_frame(child.reader)
            except wire.WireError as e:
                return f"sent a bad frame ({e})"
            if msg is None:
                return "exited"
            child.answered = time.monotonic()
            if not isinstance(msg, list) or not msg:
                return "sent a frame that is not a typed list"
            if msg[0] == wire.DONE and len(msg) == 4:
                entry = child.pending.pop(msg[1], None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result((str(msg[2]), str(msg[3])))
            elif msg[0] == wire.FATAL:
                return f"failed: {msg[1] if len(msg) > 1 else ''}"
            elif msg[0] != wire.PONG:
                return f"sent an unknown frame type {msg[0]!r}"

    async def _reap(self, child: _Child, why: str) -> int | None:
        """Kill (if need be) and wait for the writer; only then do the spans it held go back (it may be reading
        them until it has exited)."""
        status = await asyncio.shield(asyncio.to_thread(_kill, child.proc))
        child.writer.close()
        for fut, _ in child.pending.values():
            if not fut.done():
                fut.set_result(("writer", why))
        child.pending.clear()
        return status

    async def close(self) -> None:
        """Let write-backs under way finish (bounded), stop the writer (STOP, then a kill) and unmap the ring."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=CLOSE_WAIT_S)
        self._closing = True
        child = self._child
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        self._set_state("closed")
        if child is not None:
            with contextlib.suppress(ConnectionError, RuntimeError):
                child.send([wire.STOP])
            await asyncio.to_thread(_stop, child.proc, STOP_WAIT_S)
            child.writer.close()
            for fut, _ in child.pending.values():
                if not fut.done():
                    fut.set_result(("writer", "stopped"))
            if self._tasks:  # those just answered give their spans back
                await asyncio.wait(set(self._tasks), timeout=1.0)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._child = self.pid = None
        self.ring.close()


def _kill(proc: subprocess.Popen) -> int | None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.wait()


def _stop(proc: subprocess.Popen, timeout: float) -> int | None:
    """The writer exits on STOP once its Puts are done; killed past ``timeout``."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return _kill(proc)
