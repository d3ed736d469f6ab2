"""The kvstore write-back ring (:class:`ShmRing`): shared memory mapped by the prefill and by its writer process
(kvstore_writeback.py says how the two use it).

One /dev/shm file per prefill, created exclusively (mode 0600), allocated up front (a full tmpfs fails here, not with
a SIGBUS later) and unlinked at once: the writer gets the descriptor, so no file is left behind whatever happens to
either process (a file left by a crash in between is removed at the next start). A /dev/shm too small for it gives
an anonymous memfd of the same memory instead. On CUDA the mapping is page-locked once (``cudaHostRegister``), so the
page export's device-to-host copy lands in it directly. Spans are handed out first-fit (mooncake_staged.StagingRing),
never waited for."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import threading
import uuid

import torch

from services.engine.device_defaults import host_memory
from services.engine.kv_transport.base import TransferError
from services.engine.kv_transport.mooncake_staged import StagingRing
from services.engine.shared_kv import ShmSpaceError, allocated_shm_file, remove_orphaned_files

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
CUDA_HOST_REGISTER_PORTABLE = 1
"""cudaHostRegisterPortable."""
RING_NAME_RE = re.compile(r"pdserve-kvwb-(\d+)-[0-9a-f]{12}")
"""/dev/shm names of write-back rings: ``pdserve-kvwb-<prefill pid>-<random>``."""


class RingError(OSError):
    """The write-back ring could not be made (no room in /dev/shm, cannot be mapped or page-locked)."""


def remove_orphaned_rings(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove ring files left by prefills that are gone (a crash between creating and unlinking one); a file
    of a live process or of another user is never touched (shared_kv.remove_orphaned_files)."""
    return remove_orphaned_files(shm_dir, RING_NAME_RE, "kvstore write-back ring file(s) of prefills that are gone")


def _shm_file(nbytes: int, shm_dir: str) -> tuple[int, str]:
    """(descriptor, name) of a new ring file in ``shm_dir``, allocated, already unlinked; RingError when the
    directory cannot hold it."""
    try:
        fd, path = allocated_shm_file(shm_dir, f"pdserve-kvwb-{os.getpid()}-{uuid.uuid4().hex[:12]}", nbytes)
    except ShmSpaceError as e:
        raise RingError(str(e)) from e
    except OSError as e:
        raise RingError(f"{shm_dir}: {e.strerror or e}") from e
    with contextlib.suppress(OSError):
        os.unlink(path)
    return fd, path


def _memfd(nbytes: int) -> tuple[int, str]:
    """(descriptor, name) of an anonymous shared-memory file (memfd_create: the same tmpfs pages, never named,
    not bounded by the /dev/shm mount), allocated; refused past half the memory this process may still take
    (nothing else bounds it: its pages are resident from here on)."""
    mem = host_memory()
    if mem is not None and nbytes > mem.available_bytes // 2:
        raise RingError(f"memfd: only {mem.available_bytes} bytes of memory available ({mem.bound})")
    try:
        fd = os.memfd_create("pdserve-kvwb", os.MFD_CLOEXEC)
    except (AttributeError, OSError) as e:
        raise RingError(f"memfd_create: {e}") from e
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        raise RingError(f"memfd: {e.strerror or e}") from e
    return fd, "/memfd:pdserve-kvwb"


class ShmRing(StagingRing):
    """The write-back ring: StagingRing's spans over shared memory mapped here and in the writer process (module
    docstring), taken without waiting (``try_take``)."""

    def __init__(self, nbytes: int, device: torch.device, shm_dir: str = SHM_DIR) -> None:
        remove_orphaned_rings(shm_dir)
        try:
            fd, self.path = _shm_file(nbytes, shm_dir)
        except RingError as e:  # a container's small /dev/shm (64 MiB by default): the same memory, unnamed
            log.info("kvstore write-back ring: %s, %d bytes needed (--kvstore-write-back-bytes); using an "
                     "anonymous memfd instead", e, nbytes)
            try:
                fd, self.path = _memfd(nbytes)
            except RingError as e2:
                raise RingError(f"cannot allocate the {nbytes}-byte kvstore write-back ring "
                                f"(--kvstore-write-back-bytes): {e}; {e2}") from e2
        """Where the ring's pages live: its /dev/shm name while it had one (unlinked once mapped), or the memfd's."""
        try:
            self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise RingError(f"cannot map the {nbytes}-byte kvstore write-back ring: {e.strerror or e}") from e
        self.fd = fd
        """Kept open: every writer process started maps the ring through it."""
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.base = 0
        self.capacity = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._cv = threading.Condition()
        self.waits = 0
        """Times a write-back found no span (dropped)."""
        self._registered: torch.device | None = None
        if device.type == "cuda":  # portable: pinned for every device's context (as torch pins its own shm staging)
            with torch.cuda.device(device):
                err = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, CUDA_HOST_REGISTER_PORTABLE)
            if int(err) != 0:
                self.close()
                raise RingError(f"cannot page-lock the {nbytes}-byte kvstore write-back ring (cudaHostRegister "
                                f"error {int(err)}); lower --kvstore-write-back-bytes")
            self._registered = device

    def try_take(self, nbytes: int) -> int | None:
        """Offset of a free span of ``nbytes``, or None at once (the ring is full, or smaller than the write)."""
        try:
            return self.take(nbytes, give_up=lambda: True)
        except TransferError:
            return None

    @property
    def free_bytes(self) -> int:
        with self._cv:
            return sum(n for _, n in self._free)

    def close(self) -> None:
        """Unmap (once no span is out: a copy may still land in one) and close the descriptor."""
        if self.fd < 0:
            return
        if self.free_bytes != self.capacity:
            log.debug("kvstore write-back ring still has spans out at shutdown; left mapped until exit")
            return
        if self._registered is not None:
            with torch.cuda.device(self._registered):
                err = torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            if int(err) != 0:
                log.warning("cudaHostUnregister of the kvstore write-back ring failed (error %d)", int(err))
            self._registered = None
        self.buf = torch.empty(0, dtype=torch.uint8)
        try:
            self.mm.close()
        except BufferError:  # a view of it is still referenced somewhere: the mapping goes at exit
            pass
        os.close(self.fd)
        self.fd = -1
