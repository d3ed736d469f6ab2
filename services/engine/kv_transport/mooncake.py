"""``mooncake`` transport: the Mooncake Transfer Engine writes each chunk's pages straight into decode's
registered KV pool (TCP here, RDMA where the NIC has it); the PushKV stream carries the claim, one
descriptor per chunk and completion only.

Decode registers its whole pool (the shm-backed or private CPU tensor) once and offers it as a typed
``MooncakePool`` (segment ``host:rpc_port``, base address, size, shape, dtype). A prefill registers its
own pool once and writes, for every run of consecutive blocks, one (layer, K|V) region per entry:
source and destination are both laid out [layers, 2, blocks, ...], so a run of n blocks is one
contiguous range per region on both sides. Decode's transfer engine accepts writes only inside memory
it registered; which blocks a writer may touch is what decode issued for the reservation (checked in
the claim). Nothing from the descriptor is code or a path: the segment is a network address whose host
must be the decode the stream goes to.

Across hosts: a process's engines are reached at the address it declares (``--kv-mooncake-host``: decode's
pod IP in Kubernetes, never 127.0.0.1 there); the segments it advertises are ``host:rpc_port`` of that
address, and a prefill writes only to segments whose host is the decode it streams to (the same string,
or an address that host name resolves to). In P2P-handshake mode this Transfer Engine build listens on
every interface (RPC port and TCP data port, both from its 15000-17000 range) whatever
MC_TCP_BIND_ADDRESS says; the engine is still handed that variable from the declared host (other modes
and builds read it), never from a user's environment.

Several engines per process (``--kv-mooncake-engines``): one TCP engine moves its bytes on a single I/O
thread (~3 GB/s over loopback on the H200 host); decode registers the same memory with each and advertises
them all (``MooncakePool.extra_segments``), and a writer spreads a chunk's entries round-robin over as
many (own engine, decode segment) pairs as both sides have, all batches in flight at once
(benchmarks/mooncake_tcp_probe.py ``--engines``).

Speculative decoding: a decode with a draft region registers its draft pool with the same engines and offers it
beside the target pool (``DraftPool.mooncake``, region_pools.py); a writer then fills both pools, each run of
blocks one range per (layer, K|V) of each. Tensor parallelism: every rank has its own engines
(parallel/mooncake_ranks.py).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import threading
import time

import grpc
import torch

from services.common.kv_kinds import pool_id
from services.common.kv_mooncake import keep_for_process_life
from services.common.pb import decode_pb2
from services.engine.kv_transport.base import KVSender, PageWriter, TransferError
from services.engine.shared_kv import (
    DTYPES,
    SharedKVAttachError,
    _dtype_name,
    _runs,
    _shape_and_dtype,
)

METADATA_SERVER = "P2PHANDSHAKE"
"""Transfer-engine metadata service: peers exchange segment descriptors directly (no etcd)."""


def available() -> str | None:
    """None when the Mooncake Transfer Engine can be loaded here, else why not."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as e:  # ImportError, or a native library missing (libibverbs)
        return f"mooncake transfer engine unavailable: {e!r}"
    return None


_ENV_LOCK = threading.Lock()
"""Held while an engine reads its environment at initialize (MC_TCP_BIND_ADDRESS is per engine)."""


class MooncakeEngine:
    """``count`` transfer engines of one process, all reached at ``hostname``; ``te`` / ``segment`` are the first.

    Invariant: every registered tensor is registered with every engine, at the same address."""

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "", count: int = 1) -> None:
        from mooncake.engine import TransferEngine

        self.tes: list[TransferEngine] = []
        with _ENV_LOCK:
            # The native engine takes its TCP bind address only from the environment, at initialize: set it
            # from the declared host each time (a stale value, e.g. another engine's host, never leaks in).
            os.environ["MC_TCP_BIND_ADDRESS"] = hostname
            for _ in range(max(1, count)):
                te = TransferEngine()
                keep_for_process_life(te)
                rc = te.initialize(hostname, METADATA_SERVER, protocol, device)
                if rc != 0:
                    raise SharedKVAttachError("mooncake", f"Mooncake transfer engine failed to start on {hostname} "
                                                          f"({protocol}, rc={rc})")
                self.tes.append(te)
        self.te = self.tes[0]
        self.hostname = hostname
        self.protocol = protocol
        self.segments = [f"{_wrap(hostname)}:{te.get_rpc_port()}" for te in self.tes]
        self.segment = self.segments[0]
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous CPU tensor's memory (once) with every engine; returns its address."""
        if tensor.is_cuda or not tensor.is_contiguous():
            raise SharedKVAttachError("mooncake", "only a contiguous CPU tensor can be registered (non-CUDA build)")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if self._registered.get(addr) != nbytes:
                for te in self.tes:
                    rc = te.register_memory(addr, nbytes)
                    if rc != 0:
                        raise SharedKVAttachError("mooncake", f"Mooncake register_memory failed (rc={rc})")
                self._registered[addr] = nbytes
        return addr

    def submit(self, segments: list[str], srcs: list[int], dsts: list[int],
               lens: list[int]) -> list[tuple[object, int]]:
        """Start writing entries (srcs[i] here -> dsts[i] at the peer, lens[i] bytes), spread round-robin over
        (engine k, segments[k]) for k < min(engines, segments); returns the batches, all in flight, in entry
        order. One batch per entry: :func:`settle` polls a batch through ``transfer_check_status``, which
        reads a batch's first entry only."""
        pairs = list(zip(self.tes, segments, strict=False))
        batches: list[tuple[object, int]] = []
        for i, (src, dst, n) in enumerate(zip(srcs, dsts, lens, strict=True)):
            te, segment = pairs[i % len(pairs)]
            batch = te.batch_transfer_async_write(segment, [src], [dst], [n])
            if batch <= 0:
                settle(batches)
                raise TransferError(f"Mooncake refused the write to {segment} (batch id {batch})",
                                    grpc.StatusCode.UNAVAILABLE)
            batches.append((te, batch))
        return batches


POLL_S = 0.0002
"""Sleep between two status reads of a batch still in flight (seconds). The binding's own wait
(``get_batch_transfer_status``) spins on a core, GIL released, until the batch ends: on the H200 host such
spinners and the engines' I/O threads slowed the prefill engine thread's kernel launches ~1.6x
(benchmarks/tail_probe.py, docs/reports/performance-history-2026-12-01.md); polling costs ~2 ms of CPU per 64 MiB moved."""


SETTLE_BASE_S = 30.0
"""Seconds :func:`settle` waits for its batches beyond the time their bytes take at SETTLE_BYTES_PER_S (the
rule of the binding's ``get_batch_transfer_status``: 30 s + 1 ns/byte). The engine reports a slice timeout
only when MC_SLICE_TIMEOUT > 0 (off by default): without this limit a frozen peer would be polled forever."""

SETTLE_BYTES_PER_S = 1e9
"""Slowest rate (bytes/s) :func:`settle` allows for the bytes it is told of."""


def settle(batches: list[tuple[object, int]], nbytes: int = 0) -> int:
    """Wait for every batch of :meth:`MooncakeEngine.submit` (each is freed once it ended: completed or
    failed); 0 or the first failure (-1 failed, -2 timed out, a batch the engine then keeps). ``nbytes``: the
    bytes the batches move; past SETTLE_BASE_S + nbytes / SETTLE_BYTES_PER_S a batch still in flight counts
    as timed out (-2) and the batches after it are read once each."""
    deadline = time.monotonic() + SETTLE_BASE_S + nbytes / SETTLE_BYTES_PER_S
    rc = 0
    for te, batch in batches:
        while (status := te.transfer_check_status(batch)) == 0:  # type: ignore[attr-defined]
            if time.monotonic() >= deadline:
                status = -2
                break
            time.sleep(POLL_S)
        if status != 1 and rc == 0:
            rc = status
    return rc


def segments_of(pool: decode_pb2.MooncakePool) -> list[str]:
    """Every transfer-engine session a Mooncake destination offers, the primary first."""
    return [pool.segment, *pool.extra_segments]


def _wrap(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def export_pool(engine: MooncakeEngine, pool: torch.Tensor) -> decode_pb2.KVDestination:
    """Decode side: register the KV pool and describe it for prefills."""
    base = engine.register(pool)
    return decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(
        segment=engine.segment, base_address=base, pool_bytes=pool.numel() * pool.element_size(),
        shape=list(pool.shape), dtype=_dtype_name(pool.dtype), protocol=engine.protocol,
        extra_segments=engine.segments[1:]))


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


def _addresses(host: str) -> set[str]:
    """``host`` itself and, for a name, the addresses it resolves to (blocking: call off the event loop)."""
    try:
        ipaddress.ip_address(host)
        return {host}
    except ValueError:
        pass
    try:
        return {host} | {str(info[4][0]) for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return {host}


def check_pool(pool: decode_pb2.MooncakePool, decode_address: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Every check of a Mooncake destination: each of its segments is on the decode the stream goes to (its
    host is ``decode_address``'s host or an address that name resolves to; blocking when it is a name), its
    shape and dtype are a pool's and its size matches them (a landing area's: its slots, each a page of the pool's
    shape and dtype and the page's other regions, ``slot_bytes``). Returns (shape, dtype)."""
    shape, dtype = _shape_and_dtype(list(pool.shape), pool.dtype)
    decode_host = _host(decode_address)
    resolved: set[str] | None = None
    for segment in segments_of(pool):
        host = _host(segment)
        if host != decode_host:
            resolved = resolved if resolved is not None else _addresses(decode_host)
            if not host or host not in resolved:
                raise SharedKVAttachError("host", f"Mooncake segment {segment!r} is not on the decode at "
                                                  f"{decode_address!r}")
        port = segment.rsplit(":", 1)[-1]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise SharedKVAttachError("segment", f"Mooncake segment {segment!r} has no valid port")
    target = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    page = target // shape[2]
    slot = pool.slot_bytes or page
    if pool.slot_bytes and (not pool.page_major or pool.slot_bytes < page):
        raise SharedKVAttachError("shape", f"Mooncake pool with slots of {pool.slot_bytes} bytes (a landing area's "
                                           f"slot holds a page of shape {list(shape)} {pool.dtype}: {page} bytes "
                                           f"and its other regions)")
    if pool.pool_bytes != shape[2] * slot or not pool.base_address:
        raise SharedKVAttachError("shape", f"Mooncake pool of {pool.pool_bytes} bytes at {pool.base_address:#x} "
                                           f"does not hold shape {list(shape)} {pool.dtype}"
                                           f"{f' in slots of {slot} bytes' if pool.slot_bytes else ''}")
    if pool.dtype not in DTYPES:
        raise SharedKVAttachError("dtype", f"unknown pool dtype {pool.dtype!r}")
    return shape, dtype


class MooncakeWriter(PageWriter):
    """Prefill side, one request: writes its pages into decode's pool through the transfer engine.

    ``write`` submits the chunk's batches (engine thread, returns at once); ``wait`` blocks until they landed."""

    transport = "mooncake"
    overlaps_compute = True

    def __init__(self, engine: MooncakeEngine, src: torch.Tensor, dest: decode_pb2.KVDestination,
                 dest_blocks: list[int], extras: list[tuple[torch.Tensor, decode_pb2.MooncakePool]] | None = None
                 ) -> None:
        pool = dest.mooncake
        self.engine = engine
        self.src = src
        self.segment = pool.segment
        self.segments = segments_of(pool)
        self.dest = dest_blocks
        self.pool_id = pool_id(dest)
        self.planes = [PoolPlane(engine, src, pool)]
        """The pools each page is written into: the target pool, then each other region's pool (index keys, draft
        KV; region_pools.py) at the same block ids (registered with the same engines: their checks are the
        caller's)."""
        self.planes.extend(PoolPlane(engine, *extra) for extra in extras or ())
        self.sender: KVSender | None = None
        self._batches: list[_Batch] = []
        self._lock = threading.Lock()

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for a, b, n in _runs(src_blocks, self.dest[first_block:first_block + len(src_blocks)]):
            for p in self.planes:
                rb = p.region_bytes
                for r in range(p.regions):
                    srcs.append(p.src_base + (r * p.src_blocks + a) * rb)
                    dsts.append(p.dst_base + (r * p.dst_blocks + b) * rb)
                    lens.append(n * rb)
        if not srcs:
            return None
        batch = _Batch(self.engine.submit(self.segments, srcs, dsts, lens), sum(lens))
        with self._lock:
            self._batches.append(batch)
        return batch

    def _settle(self, b: _Batch) -> int:
        """The write's result; exactly one thread asks the engines for it (a batch is freed once read)."""
        with self._lock:
            mine = not b.claimed
            b.claimed = True
        if mine:
            b.rc = settle(b.batches, b.nbytes)
            b.done.set()
        b.done.wait()
        return b.rc

    def wait(self, handle: object) -> None:
        if handle is None:
            return
        assert isinstance(handle, _Batch)
        rc = self._settle(handle)
        if rc != 0:
            raise TransferError(f"Mooncake write to {self.segment} failed (rc={rc})", grpc.StatusCode.UNAVAILABLE)

    def quiesce(self) -> None:
        """Block until no batch is in flight; failures are reported by :meth:`wait`."""
        with self._lock:
            batches = list(self._batches)
        for batch in batches:
            self._settle(batch)


class PoolPlane:
    """One pool a writer fills: source cache [layers, planes, blocks, ...] here (2 planes: K and V; 1: index keys),
    the same layout at decode (shapes checked by the caller), both registered; a run of n blocks is one range per
    (layer, plane) region."""

    def __init__(self, engine: MooncakeEngine, src: torch.Tensor, pool: decode_pb2.MooncakePool) -> None:
        self.src_base = engine.register(src)
        self.src_blocks = src.shape[2]
        self.dst_base = pool.base_address
        self.dst_blocks = int(pool.shape[2])
        self.region_bytes = src[0, 0, 0].numel() * src.element_size()
        """Bytes of one block of one (layer, plane) region: equal on both sides."""
        self.regions = src.shape[0] * src.shape[1]


class _Batch:
    """One write's transfer-engine batches (several engines' at once) and its result, read once."""

    def __init__(self, batches: list[tuple[object, int]], nbytes: int) -> None:
        self.batches = batches
        self.nbytes = nbytes
        self.claimed = False
        self.rc = 0
        self.done = threading.Event()
