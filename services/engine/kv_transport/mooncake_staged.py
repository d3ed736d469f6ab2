"""``mooncake`` with a device pool: pinned host staging on both sides (the non-CUDA Transfer Engine moves
host memory only).

Prefill: the engine's page-export API gathers a chunk's pages on a side stream straight into a span of
a pinned host **staging ring** registered with the transfer engine once per process (page-major: one
page after another, so a run of consecutive destination blocks is one contiguous range on both sides
and one transfer-engine entry). ``write`` (engine thread) only enqueues that GPU work and returns;
``wait`` (a worker thread) waits for the copy's CUDA event, has the transfer engine write the span into
decode's landing area, then frees the span. The compute stream waits for the gather only, never for
the host copy or the network.

Decode: a pinned host **landing area** mirrors the device pool page by page and is what decode registers and
offers (``MooncakePool.page_major``): landing slot b belongs to pool block b, so the reservation and claim
checks that guard the pool guard it unchanged. When a chunk's descriptor arrives the pages are in the landing
area; the engine thread imports them into the device pool (one host-to-device copy per run plus the page
scatter, queued on the compute stream ahead of any step that reads them).

Page regions (kv_layout.PageLayout.regions: the target's K/V or latent, then DeepSeek-V3.2's index keys, then a
draft's KV): a slot holds the block's whole page, every region's bytes back to back in layout order, exactly as
the page crosses the grpc stream (page_regions.py: the target in the pool's dtype, each other region in its own
codec). So a run of consecutive blocks is still one contiguous range and one entry; the prefill's page export
packs every region of the run into the staging span, and decode's import scatters each region into its pool. A
target-only slot is [layers, 2, block_size, kv_heads, head_dim] of the pool's dtype. The landing names its slot's
regions and size (``MooncakePool.regions``, ``slot_bytes``); a writer whose pages have other regions or another size
refuses it, naming both (``check_landing``: the pages then go as bytes).

Codec (negotiated at Reserve, independent of the transport): a request whose prefill and decode agreed on
fp8-e4m3 (decode lists its fingerprint in ``accepted_wire_fingerprints``, the prefill is configured for it,
the claim names it) stages quantized pages (``export`` with the codec: the Triton pack on the side stream
on GPU, the torch reference on CPU): uint8 [P, fp8 page bytes], values then per-token-per-head scales.
With other regions an fp8 page is the target's fp8 bytes then every other region as stored (the wire codec
re-encodes the target region only, page_regions.py). The landing keeps its native page-major slots; a run of m
consecutive destination blocks starting at b lands its m fp8 pages back to back from slot b's first byte (both
sides cut one descriptor's blocks into the same maximal runs, shared_kv._runs). fp8 page bytes <= native page
bytes (``codec_fits``), so a run's fp8 bytes stay inside its own blocks' slots: the claim and reservation checks
guard them unchanged, and one run is still one contiguous range on both sides. Decode imports such a run with the
codec (the target dequantized into the pool, the other regions copied, on the engine thread).

Both sides work with host tensors standing in for the device (CPU tests exercise the whole path).
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from services.common.kv_kinds import pool_id
from services.common.pb import decode_pb2
from services.engine.kv_layout import FP8_CODEC, PageLayout, Region
from services.engine.kv_pages import PageExport
from services.engine.kv_transport.base import KVSender, PageWriter, TransferError
from services.engine.kv_transport.mooncake import MooncakeEngine, segments_of, settle
from services.engine.kv_transport.mooncake_groups import GroupWrite
from services.engine.region_pools import region_name
from services.engine.shared_kv import SharedKVAttachError, _dtype_name, _runs, _shape_and_dtype

ALIGN = 4096
"""Staging spans start on page boundaries (bytes)."""
RING_WAIT_S = 60.0
"""Longest the engine thread waits for staging space before the chunk's request fails (seconds)."""
ENTRY_BYTES = 4 << 20
"""Largest transfer-engine entry (bytes). Over TCP each entry is one connection's session, moved 64 KiB
at a time through the engine's single I/O thread; many entries in flight let each wake-up of that
thread serve many connections, which keeps a chunk's transfer fast on a loaded host
(benchmarks/mooncake_tcp_probe.py)."""
PIECE_BYTES = 32 << 20
"""A write's pages are exported in pieces of about this many bytes (each its own gather and device-to-host copy
on the side stream, with its own event), and the transfer-engine entries whose source bytes a piece completes
are submitted as soon as it lands: the network starts on the first piece while the rest are still copied."""


def _pinned(nbytes: int, what: str) -> torch.Tensor:
    """Host bytes, page-locked when a GPU is there to copy from/to them asynchronously; a host that cannot
    lock that much is a SharedKVAttachError (the caller falls back), not a crash."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    except RuntimeError as e:
        raise SharedKVAttachError(what, f"cannot allocate {nbytes} bytes of pinned host memory for the Mooncake "
                                        f"{what} area: {e}") from e


class StagingRing:
    """Pinned host bytes registered once; first-fit spans handed to writes and given back after transfer.

    Invariant: a span is owned by exactly one in-flight write from ``take`` until ``give``; the free list
    is sorted by offset and holds no two adjacent spans."""

    def __init__(self, engine: MooncakeEngine, nbytes: int) -> None:
        self.buf = _pinned(nbytes, "staging")
        self.base = engine.register(self.buf)
        self.capacity = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._cv = threading.Condition()
        self.waits = 0
        """Times a write found the ring full and waited (backpressure on the engine thread)."""

    def take(self, nbytes: int, give_up: Callable[[], bool] = lambda: False) -> int:
        """Offset of a free span of ``nbytes`` (blocks while the ring is full; ``give_up`` ends the wait)."""
        size = -(-nbytes // ALIGN) * ALIGN
        if size > self.capacity:
            raise TransferError(f"a write of {nbytes} bytes exceeds the Mooncake staging ring ({self.capacity} "
                                "bytes; raise --kv-mooncake-staging-bytes)", grpc.StatusCode.RESOURCE_EXHAUSTED)
        deadline = time.monotonic() + RING_WAIT_S
        with self._cv:
            waited = False
            while True:
                for i, (off, n) in enumerate(self._free):
                    if n >= size:
                        self._free[i:i + 1] = [(off + size, n - size)] if n > size else []
                        return off
                if not waited:
                    waited = True
                    self.waits += 1
                if give_up() or time.monotonic() > deadline:
                    raise TransferError("no Mooncake staging space freed in time (transfers stalled)",
                                        grpc.StatusCode.UNAVAILABLE)
                self._cv.wait(0.05)

    def give(self, off: int, nbytes: int) -> None:
        size = -(-nbytes // ALIGN) * ALIGN
        with self._cv:
            spans = sorted([*self._free, (off, size)])
            merged: list[tuple[int, int]] = []
            for o, n in spans:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((o, n))
            self._free = merged
            self._cv.notify_all()

    def view(self, off: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        return self.buf[off:off + nbytes].view(dtype).view(shape)


def codec_fits(layout: PageLayout, slot_bytes: int, regions: Sequence[Region] = ()) -> bool:
    """Whether pages in ``layout`` may travel through landing slots of ``slot_bytes`` (one native page of every
    region) that hold ``regions`` beside the target: fp8-e4m3 of the target region, the slots' other regions as
    stored, a page no larger than a slot (module docstring)."""
    return layout.target_codec == FP8_CODEC and layout.regions[1:] == tuple(regions) and \
        layout.page_bytes <= slot_bytes


def _codec_of(dtype: object) -> str:
    """The codec a target region in ``dtype`` (a torch dtype or its name) is named with; the name when none."""
    try:
        return PageLayout.codec_for_dtype(dtype)
    except ValueError:
        return str(dtype).removeprefix("torch.")


def slot_of(page_shape: tuple[int, ...], dtype: torch.dtype, regions: Sequence[Region]) -> tuple[list[str], int]:
    """(names, bytes) of a landing slot holding one page of a target region of ``page_shape`` / ``dtype`` and then
    of each of ``regions``: the names as ``MooncakePool.regions`` lists them (region_pools.region_name)."""
    target = Region("target", _codec_of(dtype), math.prod(page_shape) * torch.empty((), dtype=dtype).element_size())
    every = (target, *regions)
    return [region_name(r) for r in every], sum(r.bytes_per_page for r in every)


def check_landing(pool: decode_pb2.MooncakePool, page_shape: tuple[int, ...], dtype: torch.dtype,
                  regions: Sequence[Region]) -> int:
    """Bytes of one slot of the landing area ``pool`` when its slots hold this writer's pages (a target region of
    ``page_shape`` / ``dtype``, then ``regions``); else SharedKVAttachError naming both (reason: the kind of the
    first region that differs, ``shape`` for the target's or the sizes alone)."""
    ours, slot = slot_of(page_shape, dtype, regions)
    shape, their_dtype = _shape_and_dtype(list(pool.shape), pool.dtype)
    theirs = list(pool.regions) or [f"target:{_codec_of(their_dtype)}"]
    their_slot = pool.slot_bytes or slot_of((*shape[:2], *shape[3:]), their_dtype, ())[1]
    if theirs == ours and their_slot == slot:
        return slot
    at = next((i for i, (a, b) in enumerate(itertools.zip_longest(theirs, ours)) if a != b), 0)
    differs = (theirs[at] if at < len(theirs) else ours[at]) if at else "shape"
    raise SharedKVAttachError(differs.split("[", 1)[0].split(":", 1)[0] or "shape",
                              f"the decode's Mooncake landing area holds pages of {'+'.join(theirs)} ({their_slot} "
                              f"bytes a slot), this prefill's pages are {'+'.join(ours)} ({slot} bytes)")


class _State(enum.Enum):
    STAGED = "staged"      # the export fills the span; not sent yet
    SENDING = "sending"    # the transfer engine is writing it
    DONE = "done"          # sent (or failed); the span is back in the ring
    DROPPED = "dropped"    # the stream failed before it was sent; the span is back in the ring


@dataclass
class _Staged:
    """One write: its span, the exports filling it (piece by piece: each with the span byte it completes, in
    order), and the transfer-engine entries that send it (in ascending source order)."""

    off: int
    nbytes: int
    pieces: list[tuple[PageExport, int]]
    srcs: list[int]
    dsts: list[int]
    lens: list[int]
    state: _State = _State.STAGED
    group: GroupWrite | None = None
    """Set for a write sent layer group by layer group while its chunk computes (``start_groups``)."""

    def exported(self) -> None:
        """Block until every piece is in the span."""
        for export, _ in self.pieces:
            export.wait()


class PageExporter(Protocol):
    def __call__(self, block_ids: list[int], codec: str | None, out: torch.Tensor,
                 layers: tuple[int, int] | None = None) -> PageExport:
        """The engine's page export (kv_pages.KVPages.export) into ``out``; ``layers``: only that layer range."""


class StagedWriter(PageWriter):
    """Prefill side, one request: pages -> staging span (export API) -> decode's landing area (TE write).

    ``export(block_ids, codec, out[, layers])`` is the engine's page export into ``out`` (a staging view): pages
    [P, *page_shape] of ``dtype`` for the target region alone, else uint8 [P, page bytes of every region] (and uint8
    [P, codec page bytes] in a wire codec). SharedKVAttachError when decode's landing slots do not hold this
    writer's pages (check_landing)."""

    transport = "mooncake"
    overlaps_compute = True

    def __init__(self, engine: MooncakeEngine, ring: StagingRing, page_shape: tuple[int, ...], dtype: torch.dtype,
                 export: PageExporter, dest: decode_pb2.KVDestination,
                 dest_blocks: list[int], regions: Sequence[Region] = ()) -> None:
        pool = dest.mooncake
        self.engine, self.ring, self.export = engine, ring, export
        self.page_shape, self.dtype = page_shape, dtype
        """The target region's page (the pool's [layers, 2, block_size, kv_heads, head_dim]) and dtype."""
        self.regions = tuple(regions)
        """The page's regions beside the target's (index keys, draft KV), in layout order: each staged page and each
        landing slot holds them after the target region."""
        self.slot_bytes = check_landing(pool, page_shape, dtype, self.regions)
        """Bytes of one landing slot (one native page of every region): destination block b starts at b * slot_bytes."""
        self.page_bytes = self.slot_bytes
        """Bytes of one staged page in the codec this request carries (native until ``carry``)."""
        self.segment, self.dst_base = pool.segment, pool.base_address
        self.segments = segments_of(pool)
        self.dest = dest_blocks
        self.pool_id = pool_id(dest)
        self.sender: KVSender | None = None
        self._lock = threading.Lock()
        self._writes: list[_Staged] = []
        self._sending = 0
        self._closed = False

    def carry(self, layout: PageLayout) -> bool:
        """Stage and send pages in ``layout``'s codec (fp8-e4m3 of the target region, the other regions as stored)
        for this request; called before the claim and the first write. False (nothing changes) for a layout whose
        pages would not fit the landing slots or whose other regions are not theirs."""
        if not codec_fits(layout, self.slot_bytes, self.regions):
            return False
        self.wire_codec, self.page_bytes = FP8_CODEC, layout.page_bytes
        return True

    def _broken(self) -> bool:
        """Also broken once quiesced (the writer closed): nothing more may be staged or sent."""
        return self._closed or super()._broken()

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        n = len(src_blocks)
        self._check_write(first_block, n)
        if not n:
            return None
        pb = self.page_bytes
        nbytes = n * pb
        off = self.ring.take(nbytes, self._broken)
        pieces: list[tuple[PageExport, int]] = []
        try:
            out = self.ring.view(off, (n, pb), torch.uint8) if self.wire_codec or self.regions else \
                self.ring.view(off, (n, *self.page_shape), self.dtype)
            step = max(1, PIECE_BYTES // pb)  # pages per piece
            for i in range(0, n, step):
                pieces.append((self.export(src_blocks[i:i + step], self.wire_codec or None, out[i:i + step]),
                               min(n, i + step) * pb))
        except BaseException:
            for export, _ in pieces:  # nothing may still copy into the span once it is given back
                export.wait()
            self.ring.give(off, nbytes)
            raise
        srcs, dsts, lens = [], [], []
        # Page-major on both sides (each page every region's bytes): a run of consecutive destination blocks is one
        # contiguous range (in a codec, its pages back to back from the run's first slot: inside the run's own slots).
        for a, b, m in _runs(list(range(n)), self.dest[first_block:first_block + n]):
            src, dst, left = self.ring.base + off + a * pb, self.dst_base + b * self.slot_bytes, m * pb
            while left:  # entries of at most ENTRY_BYTES
                k = min(left, ENTRY_BYTES)
                srcs.append(src)
                dsts.append(dst)
                lens.append(k)
                src, dst, left = src + k, dst + k, left - k
        w = _Staged(off, nbytes, pieces, srcs, dsts, lens)
        with self._lock:
            self._writes.append(w)
        return w

    def start_groups(self, first_block: int, src_blocks: list[int], cleared: Callable[[], bool | None] = lambda: True,
                     clear_wait_s: float = 0.0) -> GroupWrite | None:
        """Engine thread, before the forward that computes these pages (a request's last chunk): stage and send
        them layer group by layer group as the forward hands the groups over (mooncake_groups.py); the returned
        sink's ``handle`` goes where ``write``'s would. None (nothing taken) when this request carries a wire
        codec or its pages other regions: an fp8-e4m3 page is all layers' values then all layers' scales, and a page
        of several regions is each region's layers after the other's, so a layer group of either is not one range
        of decode's landing slot; such pages go whole through ``write`` once the chunk is computed.
        ``cleared`` / ``clear_wait_s``: nothing is submitted before the claim is acknowledged (GroupWrite)."""
        n = len(src_blocks)
        if self.wire_codec or self.regions or not n:
            return None
        self._check_write(first_block, n)
        nbytes = n * self.page_bytes
        off = self.ring.take(nbytes, self._broken)
        w = _Staged(off, nbytes, [], [], [], [], _State.SENDING)
        with self._lock:  # quiesce closes under the lock: a write it did not see is never started
            closed = self._closed
            if not closed:
                self._writes.append(w)
                self._sending += 1
        if closed:
            self.ring.give(off, nbytes)
            raise TransferError("KV stream to decode ended: chunk not sent", grpc.StatusCode.CANCELLED)
        w.group = GroupWrite(self, w, first_block, src_blocks, ENTRY_BYTES, cleared, clear_wait_s)
        return w.group

    def _done(self, w: _Staged) -> None:
        """A sent (or failed) write's transfers settled and its copies landed: its span goes back to the ring."""
        with self._lock:
            self._sending -= 1
            w.state = _State.DONE
            self._writes.remove(w)
        self.ring.give(w.off, w.nbytes)

    def wait(self, handle: object) -> None:
        if handle is None:
            return
        assert isinstance(handle, _Staged)
        if handle.group is not None:
            handle.group.wait()
            return
        first, _ = handle.pieces[0]
        first.wait()  # the first piece is in the span
        with self._lock:
            send = handle.state is _State.STAGED and not self._broken()
            if send:
                handle.state = _State.SENDING
                self._sending += 1
        if not send:
            handle.exported()
            with self._lock:
                self._drop(handle)
            raise TransferError("KV stream to decode is broken: chunk not sent", grpc.StatusCode.CANCELLED)
        try:
            rc = settle(self._send(handle))
        finally:
            self._done(handle)
        if rc != 0:
            raise TransferError(f"Mooncake write to {self.segment} failed (rc={rc})", grpc.StatusCode.UNAVAILABLE)

    def _send(self, w: _Staged) -> list[tuple[object, int]]:
        """Submit each entry once the piece holding its last source byte has landed; the batches, in flight."""
        base = self.ring.base + w.off
        batches: list[tuple[object, int]] = []
        k = 0
        try:
            for export, ready in w.pieces:
                export.wait()
                e = k
                while e < len(w.srcs) and w.srcs[e] - base + w.lens[e] <= ready:
                    e += 1
                if e > k:
                    batches += self.engine.submit(self.segments, w.srcs[k:e], w.dsts[k:e], w.lens[k:e])
                    k = e
        except BaseException:
            settle(batches)  # nothing in flight reads or fills the span once it is given back
            w.exported()
            raise
        assert k == len(w.srcs)
        return batches

    def _drop(self, w: _Staged) -> None:
        """(lock held) Give back the span of a write that will never be sent (its export has finished)."""
        if w.state is _State.STAGED:
            w.state = _State.DROPPED
            self._writes.remove(w)
            self.ring.give(w.off, w.nbytes)

    def release_source(self) -> None:
        """Engine thread, last chunk: the compute stream already waits for every gather (export API), so the
        source blocks may be reused at once; the host copies and transfers go on in worker threads."""
        return None

    def quiesce(self) -> None:
        """Worker thread, when the stream ends early: nothing more is sent, and every transfer under way has
        ended (decode may then free the blocks it targets); unsent spans go back to the ring."""
        with self._lock:
            self._closed = True
            pending = [w for w in self._writes if w.state is _State.STAGED]
            groups = [w.group for w in self._writes if w.group is not None]
        for g in groups:
            g.stop()
        for w in pending:
            w.exported()
            with self._lock:
                self._drop(w)
        while True:
            with self._lock:
                if not self._sending:
                    return
            time.sleep(0.005)


class HostLanding:
    """Decode side: a registered pinned host mirror of a device pool and its other regions' pools, page by page
    (module docstring)."""

    def __init__(self, engine: MooncakeEngine, pool: torch.Tensor,
                 import_pages: Callable[..., None], regions: Sequence[Region] = ()) -> None:
        """``pool``: the target region's pool [layers, 2, blocks, ...]; ``regions``: the page's other regions in
        layout order (their pools have the target pool's block ids; the page import writes them)."""
        layers, two, blocks, *rest = pool.shape
        self.page_shape = (layers, two, *rest)
        self.regions = tuple(regions)
        names, self.slot_bytes = slot_of(self.page_shape, pool.dtype, self.regions)
        """Bytes of one slot: one page of every region (slot b at b * slot_bytes)."""
        buf = _pinned(blocks * self.slot_bytes, "landing")
        self.slots = buf.view(blocks, self.slot_bytes)
        """uint8 [blocks, slot_bytes]: slot b holds pool block b's page."""
        self.host = self.slots if self.regions else buf.view(pool.dtype).view(blocks, *self.page_shape)
        """The slots as the page import takes them: [blocks, layers, 2, bs, kvh, hd] of the pool's dtype (the target
        region alone), else uint8 [blocks, page bytes of every region]."""
        self.engine = engine
        self.import_pages = import_pages
        """The engine's page import (engine thread): pages [P, layers, 2, bs, kvh, hd] or uint8 [P, page bytes of
        every region] (or uint8 [P, codec page bytes] with the codec as third argument) -> pool blocks."""
        self.destination = decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(
            segment=engine.segment, base_address=engine.register(buf), pool_bytes=blocks * self.slot_bytes,
            shape=list(pool.shape), dtype=_dtype_name(pool.dtype), protocol=engine.protocol,
            page_major=True, extra_segments=engine.segments[1:], regions=names, slot_bytes=self.slot_bytes))

    def accepts(self, layout: PageLayout) -> bool:
        """Whether a writer may land pages in ``layout`` (a wire codec) here."""
        return codec_fits(layout, self.slot_bytes, self.regions)

    def land(self, block_ids: list[int], layout: PageLayout | None = None) -> None:
        """Engine thread: copy the pages the writer put into ``block_ids``' landing slots into the pool, each other
        region into its own pool (``layout``: the codec they are in when not the pool's own; the target region
        dequantized on the way). Queued on the compute stream before any step that reads them; the slots are not
        written again until the blocks are freed and reserved anew (after those steps ran)."""
        codec = layout.target_codec if layout is not None and self.accepts(layout) else None
        flat, slot = self.slots.view(-1), self.slot_bytes
        for a, _, m in _runs(block_ids, block_ids):
            if codec is None:
                self.import_pages(list(range(a, a + m)), self.host[a:a + m])
            else:  # the run's pages back to back from slot a (contiguous)
                pb = layout.page_bytes
                self.import_pages(list(range(a, a + m)), flat[a * slot:a * slot + m * pb].view(m, pb), codec)
