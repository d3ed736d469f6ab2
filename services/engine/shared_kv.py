"""``shm`` and ``cuda-ipc`` payload modes: a same-host handoff straight into decode's KV pool.

A decode started with ``--kv-cache-shared`` keeps its KV pool where a prefill on the same host can
reach it and offers it as a typed ``KVDestination`` in ReserveResponse.destination:

* ``shm`` (CPU): the pool is the file ``/dev/shm/<name>``; the message carries only the name, shape,
  dtype and host id. A prefill opens nothing but ``/dev/shm/<name>`` for a name matching
  :data:`SHM_NAME_RE`, and only a regular file (not a symlink) owned by its own uid whose size is the
  pool's.
* ``cuda-ipc`` (GPU): the pool's CUDA allocation exported as a CUDA IPC memory handle plus torch's
  cross-process reference counter, as the fields of ``storage._share_cuda_()``; the prefill rebuilds
  the tensor with ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` from those typed fields.

Nothing from the message is unpickled, evaluated or used as a path: the only bytes it carries are
CUDA handles, interpreted by the CUDA driver. A descriptor from another host (different boot id) or
one that fails a check is refused with :class:`SharedKVAttachError`; the prefill then sends page bytes
in the stream instead. Which reservation the pages belong to is decided by decode (the reservation
token on every KVChunk), never by this module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import re
import socket
import stat
import uuid
from collections import OrderedDict

import torch

from services.common.kv_kinds import pool_kind
from services.common.pb import decode_pb2

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SHM_NAME_RE = re.compile(r"^pdserve-kv-[0-9]+-[0-9a-f]{12}$")
_POOL_PID_RE = re.compile(r"pdserve-kv-([0-9]+)-[0-9a-f]{12}")
"""SHM_NAME_RE with the owner's pid as group 1."""
"""The only file names a prefill opens under SHM_DIR (what :func:`create_shared_kv` makes)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}
POOL_DIMS = 6
"""[layers, 2, blocks, block_size, kv_heads, head_dim]."""
CUDA_IPC_HANDLE_MAX_BYTES = 1024
"""Longest CUDA IPC memory or event handle accepted (bytes). torch's are a cudaIpc*Handle_t (64 bytes),
the memory one behind a short type prefix (66 bytes on torch 2.11); the CUDA driver and torch's own
parser, never Python, interpret them."""
_REF_COUNTER_RE = re.compile(rb"^/torch_[0-9]+_[0-9]+_[0-9]+$")
"""torch's cross-process CUDA reference-counter shm names (at::NewProcessWideShmHandle)."""
_REF_COUNTER_SLOTS = 10000
"""Entries in one torch CUDA IPC ref-counter file (torch::CUDA_IPC_REF_COUNTER_FILE_SIZE)."""
MAX_ATTACHED_POOLS = 8
"""Decode pools a prefill keeps mapped at once (least recently used beyond it are dropped)."""


def host_id() -> str:
    """This machine (boot) instance: two processes share /dev/shm only if these are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    return f"{socket.gethostname()}/{boot}"


class SharedKVAttachError(RuntimeError):
    """A destination was refused or could not be opened; ``reason`` is a short metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise SharedKVAttachError("dtype", f"no shared-pool dtype for {dtype}")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _map(fd: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a MAP_SHARED mapping of ``fd`` (the tensor keeps the mapping alive)."""
    buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


# --- decode side: make and export the pool ------------------------------------------------------


def remove_orphaned_files(shm_dir: str, name_re: re.Pattern[str], what: str) -> list[str]:
    """Unlink files of ``shm_dir`` left by processes that died without cleaning up (kill -9): our uid's regular
    files whose whole name matches ``name_re``, its group 1 the owner's pid, when that pid no longer exists.
    Returns the names removed (logged once as ``what``). A pid reused by another process keeps its file
    (conservative); a file of another user is never touched."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for n in names:
        m = name_re.fullmatch(n)
        if m is None or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        path = os.path.join(shm_dir, n)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                removed.append(n)
        except OSError:
            continue
    if removed:
        log.info("removed %d %s: %s", len(removed), what, ", ".join(removed))
    return removed


def remove_orphaned_pools(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink pool files (``pdserve-kv-<pid>-<hex>``) left by decodes that are gone (remove_orphaned_files)."""
    return remove_orphaned_files(shm_dir, _POOL_PID_RE, "KV pool file(s) of decodes that are gone")


class ShmSpaceError(OSError):
    """A shared-memory directory has too little room for a file of the size asked for."""


def allocated_shm_file(shm_dir: str, file_name: str, nbytes: int) -> tuple[int, str]:
    """(descriptor, path) of a new file ``file_name`` in ``shm_dir`` of ``nbytes``, created exclusively (mode 0600,
    never following a link) with its pages allocated up front, so a full tmpfs fails here (ShmSpaceError when the
    directory reports too little room, OSError from the allocation) instead of with a SIGBUS on first touch. Nothing
    is left behind on failure; on success the caller owns the descriptor and the name."""
    st = os.statvfs(shm_dir)
    if st.f_bavail * st.f_frsize < nbytes:
        raise ShmSpaceError(f"{shm_dir} has {st.f_bavail * st.f_frsize} bytes free")
    path = os.path.join(shm_dir, file_name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return fd, path


def create_shared_kv(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str, decode_pb2.KVDestination]:
    """A zeroed tensor backed by a new /dev/shm file (:func:`allocated_shm_file`): (tensor, its path, the
    destination to offer)."""
    name = _dtype_name(dtype)
    nbytes = math.prod(shape) * _itemsize(dtype)
    remove_orphaned_pools()
    file_name = f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    try:
        fd, path = allocated_shm_file(SHM_DIR, file_name, nbytes)
    except ShmSpaceError as e:
        raise SharedKVAttachError("space", f"{e}; the KV pool needs {nbytes}") from e
    try:
        tensor = _map(fd, nbytes, shape, dtype)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)
    dest = decode_pb2.KVDestination(shm=decode_pb2.ShmPool(name=file_name, shape=list(shape), dtype=name,
                                                           host_id=host_id()))
    return tensor, path, dest


def export_cuda_kv(tensor: torch.Tensor) -> decode_pb2.KVDestination:
    """The CUDA IPC destination of a contiguous CUDA pool tensor. The exporting process must keep the
    tensor alive while others use it (decode's pool lives as long as decode)."""
    if not tensor.is_cuda or not tensor.is_contiguous() or tensor.storage_offset() != 0:
        raise SharedKVAttachError("layout", "only a contiguous CUDA tensor at offset 0 can be exported")
    (device, handle, storage_bytes, storage_offset, ref_handle, ref_offset, event_handle,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    return decode_pb2.KVDestination(cuda_ipc=decode_pb2.CudaIpcPool(
        host_id=host_id(), device=int(device), handle=bytes(handle), storage_bytes=int(storage_bytes),
        storage_offset=int(storage_offset), shape=list(tensor.shape), dtype=_dtype_name(tensor.dtype),
        ref_counter_handle=bytes(ref_handle or b""), ref_counter_offset=int(ref_offset),
        event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync)))


_FRONT_POOL: dict[str, int | None] = {"wanted": 0, "fd": None}
"""An engine core's pool for its front: asked for (``serve_pool_to_front``), then the memfd once made."""


def serve_pool_to_front() -> None:
    """This process is an engine core whose front reads and writes its KV pool (a prefill's, services/prefill/
    engine_port.py): the next "KV pool" :func:`allocate_kv` makes on CPU is an anonymous shared-memory file
    (memfd: no /dev/shm space, no name) whose descriptor :func:`front_pool_fd` hands over."""
    _FRONT_POOL["wanted"] = 1


def front_pool_fd() -> int | None:
    """The memfd of the pool made for the front, or None (none was asked for, or the device is not a CPU)."""
    return _FRONT_POOL["fd"]


def _memfd_pool(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed pool in a new memfd (pages allocated on first touch, as a private pool's are)."""
    nbytes = math.prod(shape) * _itemsize(dtype)
    fd = os.memfd_create("pdserve-kv-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        tensor = _map(fd, nbytes, shape, dtype)
    except BaseException:
        os.close(fd)
        raise
    _FRONT_POOL["fd"] = fd
    return tensor


def open_front_pool(fd: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The front's mapping of its engine core's pool from the memfd the core passed (SharedKVAttachError unless
    its size is the pool's)."""
    nbytes = math.prod(shape) * _itemsize(dtype)
    size = os.fstat(fd).st_size
    if size != nbytes:
        raise SharedKVAttachError("file", f"the engine core's pool file holds {size} bytes; its shape "
                                          f"{list(shape)} of {dtype} needs {nbytes}")
    return _map(fd, nbytes, shape, dtype)


def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shared: bool, what: str
                ) -> tuple[torch.Tensor, str | None, decode_pb2.KVDestination | None]:
    """A zeroed pool (``what`` names it in logs): (tensor, its /dev/shm path, the destination to offer). With
    ``shared``, backed by a /dev/shm file on CPU or exported over CUDA IPC on GPU; a pool that cannot be
    shared stays private (logged; prefills then send page bytes). The caller unlinks the path at exit. An
    engine core serving its pool to its front (:func:`serve_pool_to_front`) makes its CPU "KV pool" a memfd."""
    if _FRONT_POOL["wanted"] and device.type == "cpu" and what == "KV pool" and _FRONT_POOL["fd"] is None:
        return _memfd_pool(shape, dtype), None, None
    if shared and device.type == "cpu":
        try:
            return create_shared_kv(shape, dtype)
        except (SharedKVAttachError, OSError) as e:
            log.warning("%s stays private (prefills will send page bytes): %s", what, e)
    tensor = torch.zeros(shape, dtype=dtype, device=device)
    dest = None
    if shared and device.type == "cuda":
        try:
            dest = export_cuda_kv(tensor)
        except (SharedKVAttachError, RuntimeError) as e:
            log.warning("%s stays private (CUDA IPC export failed; prefills will send page bytes): %s", what, e)
    return tensor, None, dest


# --- prefill side: check and open a destination -------------------------------------------------


def _shape_and_dtype(shape: list[int], dtype_name: str) -> tuple[tuple[int, ...], torch.dtype]:
    if dtype_name not in DTYPES:
        raise SharedKVAttachError("dtype", f"unknown pool dtype {dtype_name!r}; known: {sorted(DTYPES)}")
    if len(shape) != POOL_DIMS or any(d <= 0 or d >= 1 << 40 for d in shape):
        raise SharedKVAttachError("shape", f"pool shape {list(shape)} is not {POOL_DIMS} positive dimensions")
    return tuple(int(d) for d in shape), DTYPES[dtype_name]


def _check_host(remote: str) -> None:
    if remote != host_id():
        raise SharedKVAttachError("host", f"the pool is on another host ({remote!r}, this is {host_id()!r})")


def open_shm_pool(pool: decode_pb2.ShmPool) -> torch.Tensor:
    """Map a decode's /dev/shm pool after every check; raises SharedKVAttachError otherwise."""
    _check_host(pool.host_id)
    if not SHM_NAME_RE.fullmatch(pool.name):
        raise SharedKVAttachError("name", f"shm pool name {pool.name!r} is not a pdserve KV pool name")
    shape, dtype = _shape_and_dtype(list(pool.shape), pool.dtype)
    nbytes = math.prod(shape) * _itemsize(dtype)
    path = os.path.join(SHM_DIR, pool.name)
    try:
        before = os.lstat(path)
    except OSError as e:
        raise SharedKVAttachError("file", f"shm pool {pool.name}: {e.strerror}") from e
    _check_file(pool.name, before, nbytes)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise SharedKVAttachError("file", f"shm pool {pool.name}: {e.strerror}") from e
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise SharedKVAttachError("file", f"shm pool {pool.name} changed while it was opened")
        _check_file(pool.name, opened, nbytes)
        return _map(fd, nbytes, shape, dtype)
    finally:
        os.close(fd)


def _check_file(name: str, st: os.stat_result, nbytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise SharedKVAttachError("file", f"shm pool {name} is not a regular file")
    if st.st_uid != os.getuid():
        raise SharedKVAttachError("file", f"shm pool {name} is owned by uid {st.st_uid}, not this process's "
                                          f"{os.getuid()}")
    if st.st_size != nbytes:
        raise SharedKVAttachError("file", f"shm pool {name} has {st.st_size} bytes, its shape needs {nbytes}")


def check_cuda_pool(pool: decode_pb2.CudaIpcPool) -> tuple[tuple[int, ...], torch.dtype]:
    """Every check of a CUDA IPC destination that needs no GPU; returns (shape, dtype)."""
    _check_host(pool.host_id)
    shape, dtype = _shape_and_dtype(list(pool.shape), pool.dtype)
    if not 0 < len(pool.handle) <= CUDA_IPC_HANDLE_MAX_BYTES:
        raise SharedKVAttachError("handle", f"CUDA IPC handle has {len(pool.handle)} bytes, expected 1 to "
                                            f"{CUDA_IPC_HANDLE_MAX_BYTES}")
    if len(pool.event_handle) > CUDA_IPC_HANDLE_MAX_BYTES or (pool.event_sync_required and not pool.event_handle):
        raise SharedKVAttachError("handle", f"CUDA IPC event handle has {len(pool.event_handle)} bytes (event sync "
                                            f"{'required' if pool.event_sync_required else 'not required'})")
    if pool.ref_counter_handle and not _REF_COUNTER_RE.fullmatch(pool.ref_counter_handle):
        raise SharedKVAttachError("handle", "CUDA IPC ref counter is not a torch ref-counter name")
    if pool.ref_counter_offset >= _REF_COUNTER_SLOTS:
        raise SharedKVAttachError("handle", f"CUDA IPC ref counter offset {pool.ref_counter_offset} is outside "
                                            f"[0, {_REF_COUNTER_SLOTS})")
    if pool.device < 0:
        raise SharedKVAttachError("device", f"CUDA device {pool.device} is negative")
    if math.prod(shape) * _itemsize(dtype) > pool.storage_bytes:
        raise SharedKVAttachError("shape", f"pool shape {list(shape)} {pool.dtype} exceeds the shared storage of "
                                           f"{pool.storage_bytes} bytes")
    return shape, dtype


def open_cuda_pool(pool: decode_pb2.CudaIpcPool) -> torch.Tensor:
    """Open a decode's CUDA pool on this host from its typed fields (GPU only)."""
    shape, dtype = check_cuda_pool(pool)
    if not torch.cuda.is_available() or pool.device >= torch.cuda.device_count():
        raise SharedKVAttachError("device", f"CUDA device {pool.device} is not visible here")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    try:
        tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shape), strides, 0, torch.UntypedStorage, dtype, pool.device,
            pool.handle, pool.storage_bytes, pool.storage_offset, False,
            pool.ref_counter_handle or None, pool.ref_counter_offset,
            pool.event_handle or None, pool.event_sync_required)
    except (RuntimeError, OSError) as e:  # the driver refused the handle
        raise SharedKVAttachError("cuda", f"cannot open the CUDA IPC handle: {e}") from e
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise SharedKVAttachError("shape", f"CUDA pool opened as {tuple(tensor.shape)} {tensor.dtype}, "
                                           f"expected {shape} {dtype}")
    return tensor


class SharedKVPools:
    """Prefill side: decode pools opened by destination, kept open (each decode's opened once).

    A cached shm pool is used only while its file still exists as the same inode (a decode that went
    away takes its file with it); at most :data:`MAX_ATTACHED_POOLS` stay open."""

    def __init__(self) -> None:
        self._pools: OrderedDict[bytes, tuple[torch.Tensor, tuple[int, int] | None]] = OrderedDict()

    def attach(self, dest: decode_pb2.KVDestination) -> torch.Tensor:
        kind = pool_kind(dest)
        if kind is None:
            raise SharedKVAttachError("none", "the decode offers no shared pool")
        key = dest.SerializeToString(deterministic=True)
        hit = self._pools.get(key)
        if hit is not None:
            tensor, ident = hit
            if ident is None or _inode(dest.shm.name) == ident:
                self._pools.move_to_end(key)
                return tensor
            del self._pools[key]
        if kind.shm_file:
            tensor = open_shm_pool(dest.shm)
            ident = _inode(dest.shm.name)
        else:
            tensor, ident = open_cuda_pool(dest.cuda_ipc), None
        self._pools[key] = (tensor, ident)
        while len(self._pools) > MAX_ATTACHED_POOLS:
            self._pools.popitem(last=False)
        return tensor


def _inode(name: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(os.path.join(SHM_DIR, name))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) runs where both block lists advance by one together."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def copy_pages(src_cache: torch.Tensor, src_blocks: list[int], dst_cache: torch.Tensor, dst_blocks: list[int]) -> None:
    """dst_cache[:, :, dst_blocks[i]] = src_cache[:, :, src_blocks[i]] (both [L, planes, blocks, ...]: a K/V pool's
    two planes, or an index-key pool's one).

    One strided copy per run of consecutive blocks: no gathered temporary (several times faster than
    advanced indexing on CPU). Every block id must be inside its cache (checked: a slice past the end
    would silently copy less)."""
    for blocks, cache, side in ((src_blocks, src_cache, "source"), (dst_blocks, dst_cache, "destination")):
        bad = next((b for b in blocks if not 0 <= b < cache.shape[2]), None)
        if bad is not None:
            raise ValueError(f"{side} block {bad} is outside the pool's {cache.shape[2]} blocks")
    planes = src_cache.shape[0] * src_cache.shape[1]
    src = src_cache.view(planes, src_cache.shape[2], -1)
    dst = dst_cache.view(planes, dst_cache.shape[2], -1)
    for a, b, n in _runs(src_blocks, dst_blocks):
        dst[:, b:b + n].copy_(src[:, a:a + n])
