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
"""

from __future__ import annotations

import math
import os
import threading

import grpc
import torch

from services.common.pb import decode_pb2
from services.engine.kv_transport.base import KVSender, PageWriter, TransferError
from services.engine.shared_kv import (
    DTYPES,
    SharedKVAttachError,
    _dtype_name,
    _runs,
    _shape_and_dtype,
    pool_id,
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


class MooncakeEngine:
    """One process's transfer engine, bound to ``hostname`` (the address peers reach it at)."""

    def __init__(self, hostname: str, protocol: str = "tcp", device: str = "") -> None:
        # The native engine takes its TCP bind address only from the environment, at initialize.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize(hostname, METADATA_SERVER, protocol, device)
        if rc != 0:
            raise SharedKVAttachError("mooncake", f"Mooncake transfer engine failed to start on {hostname} "
                                                  f"({protocol}, rc={rc})")
        self.hostname = hostname
        self.protocol = protocol
        self.segment = f"{hostname}:{self.te.get_rpc_port()}"
        self._registered: dict[int, int] = {}
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> int:
        """Register a contiguous CPU tensor's memory (once); returns its address."""
        if tensor.is_cuda or not tensor.is_contiguous():
            raise SharedKVAttachError("mooncake", "only a contiguous CPU tensor can be registered (non-CUDA build)")
        addr, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._lock:
            if self._registered.get(addr) != nbytes:
                rc = self.te.register_memory(addr, nbytes)
                if rc != 0:
                    raise SharedKVAttachError("mooncake", f"Mooncake register_memory failed (rc={rc})")
                self._registered[addr] = nbytes
        return addr


def export_pool(engine: MooncakeEngine, pool: torch.Tensor) -> decode_pb2.KVDestination:
    """Decode side: register the KV pool and describe it for prefills."""
    base = engine.register(pool)
    return decode_pb2.KVDestination(mooncake=decode_pb2.MooncakePool(
        segment=engine.segment, base_address=base, pool_bytes=pool.numel() * pool.element_size(),
        shape=list(pool.shape), dtype=_dtype_name(pool.dtype), protocol=engine.protocol))


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host.strip("[]")


def check_pool(pool: decode_pb2.MooncakePool, decode_address: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Every check of a Mooncake destination: its segment is on the decode the stream goes to, its shape
    and dtype are a pool's and its size matches them. Returns (shape, dtype)."""
    shape, dtype = _shape_and_dtype(list(pool.shape), pool.dtype)
    host = _host(pool.segment)
    if not host or _host(decode_address) != host:
        raise SharedKVAttachError("host", f"Mooncake segment {pool.segment!r} is not on the decode at "
                                          f"{decode_address!r}")
    port = pool.segment.rsplit(":", 1)[-1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SharedKVAttachError("segment", f"Mooncake segment {pool.segment!r} has no valid port")
    if pool.pool_bytes != math.prod(shape) * torch.empty((), dtype=dtype).element_size() or not pool.base_address:
        raise SharedKVAttachError("shape", f"Mooncake pool of {pool.pool_bytes} bytes at {pool.base_address:#x} "
                                           f"does not hold shape {list(shape)} {pool.dtype}")
    if pool.dtype not in DTYPES:
        raise SharedKVAttachError("dtype", f"unknown pool dtype {pool.dtype!r}")
    return shape, dtype


class MooncakeWriter(PageWriter):
    """Prefill side, one request: writes its pages into decode's pool through the transfer engine.

    ``write`` submits one batch (engine thread, returns at once); ``wait`` blocks until it landed."""

    transport = "mooncake"

    def __init__(self, engine: MooncakeEngine, src: torch.Tensor, dest: decode_pb2.KVDestination,
                 dest_blocks: list[int]) -> None:
        pool = dest.mooncake
        self.engine = engine
        self.src = src
        self.src_base = engine.register(src)
        self.segment = pool.segment
        self.dst_base = pool.base_address
        self.dst_blocks_total = int(pool.shape[2])
        self.dest = dest_blocks
        self.pool_id = pool_id(dest)
        self.region_bytes = src[0, 0, 0].numel() * src.element_size()
        """Bytes of one block of one (layer, K|V) region: equal on both sides (shapes were checked)."""
        self.regions = src.shape[0] * 2
        self.sender: KVSender | None = None
        self._batches: dict[int, _Batch] = {}
        self._lock = threading.Lock()

    def write(self, first_block: int, src_blocks: list[int]) -> object:
        self._check_write(first_block, len(src_blocks))
        nb_src, nb_dst, rb = self.src.shape[2], self.dst_blocks_total, self.region_bytes
        srcs: list[int] = []
        dsts: list[int] = []
        lens: list[int] = []
        for a, b, n in _runs(src_blocks, self.dest[first_block:first_block + len(src_blocks)]):
            for r in range(self.regions):
                srcs.append(self.src_base + (r * nb_src + a) * rb)
                dsts.append(self.dst_base + (r * nb_dst + b) * rb)
                lens.append(n * rb)
        if not srcs:
            return None
        batch = self.engine.te.batch_transfer_async_write(self.segment, srcs, dsts, lens)
        if batch <= 0:
            raise TransferError(f"Mooncake refused the write to {self.segment} (batch id {batch})",
                                grpc.StatusCode.UNAVAILABLE)
        with self._lock:
            self._batches[batch] = _Batch()
        return batch

    def _settle(self, batch: int) -> int:
        """The batch's result; exactly one thread asks the engine for it (a batch is freed once read)."""
        with self._lock:
            b = self._batches[batch]
            mine = not b.claimed
            b.claimed = True
        if mine:
            b.rc = self.engine.te.get_batch_transfer_status([batch])
            b.done.set()
        b.done.wait()
        return b.rc

    def wait(self, handle: object) -> None:
        if handle is None:
            return
        assert isinstance(handle, int)
        rc = self._settle(handle)
        if rc != 0:
            raise TransferError(f"Mooncake write to {self.segment} failed (rc={rc})", grpc.StatusCode.UNAVAILABLE)

    def quiesce(self) -> None:
        """Block until no batch is in flight; failures are reported by :meth:`wait`."""
        with self._lock:
            batches = list(self._batches)
        for batch in batches:
            self._settle(batch)


class _Batch:
    def __init__(self) -> None:
        self.claimed = False
        self.rc = 0
        self.done = threading.Event()
