"""One chunk's pages staged and sent to decode's landing area layer group by layer group while it computes.

A :class:`GroupWrite` is a layer sink (services/engine/layer_groups.py) made by ``StagedWriter.start_groups``
before the forward of a request's last chunk. Each time the forward hands over layers [a, b) (engine thread),
it has the page API gather those layers of the chunk's pages on the gather stream (after what the compute
stream queued so far) and copy them to the group's part of the staging span on the copy stream; a worker
thread waits for each group's copy and submits its Transfer Engine writes at once, so the network moves
early groups while later layers still compute. The compute stream waits for gathers only (page API).

Staging span, group-major: layers [a, b) of the n pages occupy bytes [n a Lb, n b Lb) (Lb: one layer's K and
V of one page), page i at offset i (b - a) Lb inside it, so a group's gather and device-to-host copy are one
contiguous range each. Decode's landing is page-major: layers [a, b) of destination block d start at
d * slot + a Lb and are contiguous, so each (page, group) is one Transfer Engine entry of (b - a) Lb bytes
(adjacent entries merge when both sides are contiguous: a group of every layer over consecutive blocks).

Invariant: the span is given back only after every enqueued copy into it landed and every submitted
transfer from it settled, and nothing is exported into it after the write closed (last group, ``abandon``,
a failure, or ``quiesce``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from services.engine.kv_transport.base import ClaimUnanswered, TransferError
from services.engine.kv_transport.mooncake import settle

if TYPE_CHECKING:
    from services.engine.kv_pages import PageExport
    from services.engine.kv_transport.mooncake_staged import StagedWriter, _Staged

CLAIM_POLL_S = 0.005
"""How often the worker re-reads the claim's state while no ``wake`` came (seconds): ``wake`` (the claim's
answer) and a close end the wait at once; this only bounds noticing a request that ended."""


def _merged(entries: list[tuple[int, int, int]], limit: int) -> tuple[list[int], list[int], list[int]]:
    """(srcs, dsts, lens) of ``entries`` (src, dst, len) with neighbours joined where both sides are contiguous
    (at most ``limit`` bytes per entry)."""
    srcs: list[int] = []
    dsts: list[int] = []
    lens: list[int] = []
    for s, d, n in entries:
        if lens and srcs[-1] + lens[-1] == s and dsts[-1] + lens[-1] == d and lens[-1] + n <= limit:
            lens[-1] += n
        else:
            srcs.append(s)
            dsts.append(d)
            lens.append(n)
    return srcs, dsts, lens


class GroupWrite:
    """A LayerSink staging and sending one write's pages group by group (module docstring)."""

    def __init__(self, writer: StagedWriter, w: _Staged, first_block: int, src_blocks: list[int],
                 entry_bytes: int, cleared: Callable[[], bool | None] = lambda: True, clear_wait_s: float = 0.0) -> None:
        """``cleared``: True once decode acknowledged the writer's claim (nothing is submitted before), False
        once it never will (refused, or the request ended), None while unknown; waited for at most
        ``clear_wait_s`` seconds from the prompt being computed (the last group handed over, as the deferred
        write waits from the step's end), then ClaimUnanswered (retryable). ``wake`` when the answer came.
        Staging into the span goes on meanwhile."""
        self.writer, self.w = writer, w
        self.cleared, self.clear_wait_s = cleared, clear_wait_s
        self.src = src_blocks
        self.dest = writer.dest[first_block:first_block + len(src_blocks)]
        self.num_layers = writer.page_shape[0]
        self.layer_bytes = writer.slot_bytes // self.num_layers
        self.entry_bytes = entry_bytes
        self._lock = threading.RLock()  # group_done closes the write under it when an export fails
        self._closed = False
        """No further group is exported (the last came, or the write was abandoned or failed)."""
        self._error: BaseException | None = None
        self._todo: queue.SimpleQueue[tuple[PageExport, int, int] | None] = queue.SimpleQueue()
        """(export, first layer, layers) of each group handed over, then None (the write closed)."""
        self._wake = threading.Event()
        """Set when the claim's answer came, the last group was handed over, or the write closed (ends a wait)."""
        self._computed_at: float | None = None
        """When the last group was handed over (monotonic seconds): the claim wait runs from then."""
        self._batches: list[tuple[object, int]] = []
        self._finish = threading.Lock()
        self._finished = False
        self.groups_sent = 0
        """Groups whose Transfer Engine writes were submitted (tests read it)."""
        self.first_sent: float | None = None
        """When the first group was submitted (monotonic seconds; tests read it)."""
        self._thread = threading.Thread(target=self._send, name="mooncake-layer-groups", daemon=True)
        self._thread.start()

    @property
    def handle(self) -> _Staged:
        """What ``StagedWriter.wait`` takes (as for ``write``)."""
        return self.w

    # --- engine thread (LayerSink) ---

    def group_done(self, first_layer: int, end_layer: int) -> None:
        """Never raises (it runs inside the forward): a failure closes the write and ``wait`` reports it."""
        n, lb, g = len(self.src), self.layer_bytes, end_layer - first_layer
        base = n * first_layer * lb
        with self._lock:
            if self._closed:
                return
            try:
                out = self.writer.ring.view(self.w.off + base, (n, g, *self.writer.page_shape[1:]), self.writer.dtype)
                export = self.writer.export(self.src, None, out, (first_layer, end_layer))
            except BaseException as e:  # reported by wait(), never into the forward
                self._close(TransferError(f"export of layers [{first_layer}, {end_layer}) failed: {e!r}",
                                          grpc.StatusCode.INTERNAL))
                return
            self.w.pieces.append((export, base + n * g * lb))
            last = end_layer >= self.num_layers
            if last:
                self._closed = True
                self._computed_at = time.monotonic()
        self._todo.put((export, first_layer, g))
        if last:
            self._todo.put(None)
            self._wake.set()

    def wake(self) -> None:
        """Any thread: the claim's answer came (``cleared`` is no longer None)."""
        self._wake.set()

    def abandon(self) -> None:
        self._close(TransferError("the step computing the chunk failed; its KV was not sent",
                                  grpc.StatusCode.INTERNAL))

    def _close(self, error: BaseException) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._error = self._error or error
        self._todo.put(None)
        self._wake.set()

    # --- worker threads ---

    def _clear(self) -> None:
        """Wait until decode acknowledged the claim: TransferError when it will not (refused, the request ended,
        the write failed), ClaimUnanswered when no answer came within ``clear_wait_s`` of the prompt computed."""
        while (ok := self.cleared()) is not True:
            # A failure ends the wait; a close does not (the last group closes the write too).
            if ok is False or self._error is not None:
                raise TransferError("decode did not acknowledge the KV claim; the layer groups were not sent",
                                    grpc.StatusCode.UNAVAILABLE)
            done = self._computed_at
            left = CLAIM_POLL_S if done is None else done + self.clear_wait_s - time.monotonic()
            if left <= 0:
                raise ClaimUnanswered(f"decode did not acknowledge the KV claim within {self.clear_wait_s:g} s "
                                      "(--claim-wait-s) of the prompt being computed; no layer group was written",
                                      grpc.StatusCode.UNAVAILABLE)
            self._wake.wait(min(left, CLAIM_POLL_S))
            self._wake.clear()  # the loop re-reads every condition a set announced

    def _entries(self, first_layer: int, g: int) -> tuple[list[int], list[int], list[int]]:
        """Transfer Engine (srcs, dsts, lens) of layers [first_layer, first_layer + g) (module docstring)."""
        n, lb = len(self.src), self.layer_bytes
        src0 = self.writer.ring.base + self.w.off + n * first_layer * lb
        entries = [(src0 + i * g * lb, self.writer.dst_base + b * self.writer.slot_bytes + first_layer * lb, g * lb)
                   for i, b in enumerate(self.dest)]
        return _merged(entries, self.entry_bytes)

    def _send(self) -> None:
        """Submit each group's entries once its copy landed and the claim is acknowledged, in order, until the
        last group or a close."""
        try:
            while (item := self._todo.get()) is not None:
                export, first_layer, g = item
                export.wait()
                if not self.groups_sent:
                    self._clear()
                    self.first_sent = time.monotonic()
                if self.writer._broken():
                    raise TransferError("KV stream to decode is broken: chunk not sent", grpc.StatusCode.CANCELLED)
                self._batches += self.writer.engine.submit(self.writer.segments, *self._entries(first_layer, g))
                self.groups_sent += 1
        except BaseException as e:  # reported by wait(), always as a TransferError (stop() and quiesce rely on it)
            err = e if isinstance(e, TransferError) else TransferError(
                f"sending the layer groups failed: {e!r}", grpc.StatusCode.INTERNAL)
            with self._lock:
                self._error = self._error or err
            self._close(err)

    def wait(self) -> None:
        """Block until every group was sent (or the write closed early), every transfer settled and the span is
        back in the ring; raise the write's failure. Idempotent: the sender and ``quiesce`` may both call it."""
        with self._finish:
            if not self._finished:
                self._finished = True
                rc = 0
                try:
                    self._thread.join()
                    rc = settle(self._batches)
                finally:
                    self.w.exported()  # pieces are frozen: the write is closed once the thread ended
                    self.writer._done(self.w)
                if rc != 0 and self._error is None:
                    self._error = TransferError(f"Mooncake write to {self.writer.segment} failed (rc={rc})",
                                                grpc.StatusCode.UNAVAILABLE)
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """``quiesce``: no group after this one is sent; the write ends (its failure, if any, is the caller's)."""
        self._close(TransferError("KV stream to decode ended: chunk not sent", grpc.StatusCode.CANCELLED))
        try:
            self.wait()
        except TransferError:
            pass
