"""A one-shot all-reduce for small tensors between the GPUs of one tensor-parallel instance (one host,
peer-to-peer reachable, e.g. over NVLink), captured inside the decode CUDA graphs like NCCL's.

Built on PyTorch symmetric memory (``torch.distributed._symmetric_memory``, CUDA backend): every rank
allocates one buffer of ``ONE_SHOT_MAX_BYTES`` and the ranks exchange peer mappings of it once
(rendezvous over the group's TCPStore). An all-reduce of x is ONE kernel
(``torch.ops.symm_mem.one_shot_all_reduce_copy_out``; a torch without it: a copy of x into the buffer,
then ``one_shot_all_reduce_out``): each thread copies its slice of x into this rank's buffer, all blocks meet the peers' blocks on a signal-pad barrier, each thread sums the same slice
from every rank's buffer by peer loads and writes it back into x, and a trailing barrier keeps any rank
from overwriting its buffer (the next all-reduce) while a peer still reads it. Every thread reads its own
slice of x before it writes that slice, so x may be both the input and the output.

Invariants:
- NVLink multicast stays off: :func:`forbid_multicast` sets NCCL_NVLS_ENABLE=0,
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 in this process (spawned ranks inherit
  them) before NCCL or symmetric memory starts, and nothing here calls a multimem op.
- Every rank takes the same path for the same call (it depends on shape, dtype and alignment only, equal
  on every rank), and either every rank has the fast path or none: setup ends with an agreement.
- Larger tensors (prefill), fp16, odd alignments, CPU/gloo and unreachable peers keep NCCL / gloo, and
  so does every rank when any rank's setup fails for any reason (logged as a warning with its cause).
A rank that dies while its peers spin on the barrier leaves them spinning (NCCL's abort does not reach a
symmetric-memory kernel); the instance's watcher still reports the dead rank.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import uuid
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
T = TypeVar("T")

ONE_SHOT_MAX_BYTES = 4 << 20
"""Largest all-reduce (bytes) that takes the one-shot path; above it NCCL (ring/tree) wins because every
rank reads every peer's whole tensor. 4 MiB covers the decode steps up to batch 512 of a 4096-wide model in
bf16; a prefill chunk of 8192 x 4096 bf16 (64 MiB) stays on NCCL. Measured: docs/reports/performance-history-2026-12-01.md, "GPU,
TP=2 ... one-shot all-reduce" (benchmarks/tp_bench.py --allreduce-sweep)."""

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""NVLink multicast (NVLS, multimem) can take a shared host's GPUs down: off in every process we start."""

_DTYPES = (torch.bfloat16, torch.float32)
"""What the one-shot kernel sums (it dispatches on float and bfloat16 only)."""

_ALIGN = 16
"""Bytes: the kernel's widest vector; x and its size must be multiples so x and the buffer align alike."""


def forbid_multicast() -> None:
    """Turn NVLink multicast off in this process and the ranks it spawns (before NCCL / symm mem start)."""
    os.environ.update(NO_MULTICAST_ENV)


class OneShotAllReduce:
    """Sum of x over the group's ranks, in place, for tensors :meth:`fits`."""

    def __init__(self, name: str, buffer: torch.Tensor, max_bytes: int, fused_copy: bool) -> None:
        self.name = name
        """The symmetric-memory group name (unique per TPGroup; set_group_info'd on every rank)."""
        self.buffer = buffer
        """uint8 [max_bytes], symmetric (rendezvoused) on every rank."""
        self.max_bytes = max_bytes
        self.fused_copy = fused_copy
        """The kernel copies x into the buffer itself (one_shot_all_reduce_copy_out); else a copy first."""

    def fits(self, x: torch.Tensor) -> bool:
        n = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in _DTYPES and x.is_contiguous() and 0 < n <= self.max_bytes
                and n % _ALIGN == 0 and x.data_ptr() % _ALIGN == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        symm = self.buffer.view(x.dtype)[: flat.numel()]
        if self.fused_copy:
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, flat, "sum", self.name, flat)
        else:
            symm.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.name, flat)
        return x


SETUP_TIMEOUT_S = 30.0
"""Longest one step of the setup may wait for the other ranks (an agreement all-reduce, the group name, the
rendezvous's handle exchange over the store). A rank that never enters the setup, or is stuck before a step,
makes its peers raise SetupTimeoutError naming the step, instead of spinning until the group's 120 s timeout."""

_rendezvoused = 0
"""Symmetric-memory groups this process has rendezvoused. torch numbers the store keys of its handle exchange
with one counter per process, so ranks whose counts differ (a process that already built a group, beside fresh
peers) would wait on keys the others never write: setup agrees on the counts first."""


class SetupTimeoutError(RuntimeError):
    """A rank waited SETUP_TIMEOUT_S for its peers in one setup step (the group cannot go on: a collective of
    it timed out)."""


def _agree(pg: dist.ProcessGroup, ok: bool, device: torch.device, step: str) -> bool:
    """True when every rank says ok (one NCCL all-reduce, bounded by SETUP_TIMEOUT_S)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    _bounded(pg.allreduce([flag]), step)
    return int(flag.item()) == pg.size()


def _agreed(pg: dist.ProcessGroup, why: str, device: torch.device, step: str) -> bool:
    """Every rank's verdict on one step (``why``: this rank's failure, "" for none); False on every rank when
    any rank failed, logged here with this rank's reason."""
    if _agree(pg, not why, device, step):
        return True
    log.warning("one-shot all-reduce off (NCCL only): %s", why or f"another rank failed its {step}")
    return False


def _bounded(work: dist.Work, step: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=SETUP_TIMEOUT_S))
    except RuntimeError as e:
        raise SetupTimeoutError(f"one-shot all-reduce setup: not every rank reached '{step}' within "
                                f"{SETUP_TIMEOUT_S:.0f} s (a rank never entered the setup, or is stuck before "
                                f"it): {e}") from e


def _peers(pg: dist.ProcessGroup, device: torch.device) -> str:
    """Why this rank cannot take the fast path with its peers ("" if it can): a peer GPU not P2P-reachable,
    or ranks whose processes rendezvoused different numbers of groups (one collective: an all-gather)."""
    mine = torch.tensor([device.index, _rendezvoused], dtype=torch.int64, device=device)
    every = mine.new_empty((pg.size(), 2))
    _bounded(pg._allgather_base(every, mine), "peer check")
    rows = every.tolist()
    if len({c for _, c in rows}) > 1:
        return (f"the ranks' processes rendezvoused different numbers of symmetric-memory groups "
                f"({[c for _, c in rows]}): their handle exchanges would never meet")
    if not all(torch.cuda.can_device_access_peer(device, d) for d, _ in rows if d != device.index):
        return "a peer GPU is not P2P-reachable from this one"
    return ""


def _attempt(rank: int, what: str, fn: Callable[[], T]) -> tuple[T | None, str]:
    """(fn(), "") or (None, why) when it raised (logged with the traceback): one local step of the setup."""
    try:
        return fn(), ""
    except Exception as e:  # any failure means NCCL only, on every rank
        why = f"{what} failed: {e!r}"
        log.warning("rank %d: %s", rank, why, exc_info=True)
        return None, why


@contextlib.contextmanager
def _store_timeout(store: dist.Store, seconds: float) -> Iterator[None]:
    prev = store.timeout
    store.set_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        store.set_timeout(prev)


def setup(pg: dist.ProcessGroup, store: dist.Store, rank: int, size: int, device: torch.device,
          max_bytes: int = ONE_SHOT_MAX_BYTES) -> OneShotAllReduce | None:
    """Collective (every rank of a CUDA group calls it after NCCL is up): the fast path, or None on every
    rank when any rank lacks symmetric memory, a peer is not P2P-reachable or a step fails (the reason is
    logged). Each step is local, then agreed by every rank before the next one, so a rank that failed never
    leaves its peers in a store exchange; SetupTimeoutError when a rank does not arrive at a step in time."""
    global _rendezvoused
    fused = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
    why = "" if fused or hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out") else \
        "this torch has no symm_mem.one_shot_all_reduce_out"
    with torch.cuda.device(device), _store_timeout(store, SETUP_TIMEOUT_S):
        peers = _peers(pg, device)  # a collective: every rank runs it, whatever it already knows
        if not _agreed(pg, why or peers, device, "peer check"):
            return None
        if rank == 0:
            store.set("pdserve/symm_mem_group", f"pdserve-tp-{uuid.uuid4().hex}")
        name = store.get("pdserve/symm_mem_group").decode()
        buffer, why = _attempt(rank, "symmetric memory allocation",
                               lambda: _allocate(name, store, rank, size, device, max_bytes))
        if not _agreed(pg, why, device, "allocation"):
            return None
        _rendezvoused += 1  # every rank enters this exchange now, whatever its outcome
        _, why = _attempt(rank, "symmetric memory rendezvous", lambda: _rendezvous(buffer, name))
        if not _agreed(pg, why, device, "rendezvous"):
            return None
    assert buffer is not None
    log.info("one-shot all-reduce on for tensors up to %d bytes (symmetric memory group %s, %s)", max_bytes, name,
             "one_shot_all_reduce_copy_out" if fused else "copy + one_shot_all_reduce_out")
    return OneShotAllReduce(name, buffer, max_bytes, fused)


def _allocate(name: str, store: dist.Store, rank: int, size: int, device: torch.device,
              max_bytes: int) -> torch.Tensor:
    """This rank's symmetric buffer of ``name``'s group (CUDA backend: peer mappings over cuMem/IPC, never
    NVSHMEM)."""
    from torch._C._distributed_c10d import _SymmetricMemory
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("CUDA")
    except Exception as e:  # already chosen in this process (an earlier group)
        log.debug("symmetric memory backend not set: %r", e)
    _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(name, store))
    return symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)


def _rendezvous(buffer: torch.Tensor | None, name: str) -> None:
    """Exchange peer mappings of ``buffer`` over the group's store (bounded by its timeout, SETUP_TIMEOUT_S)."""
    from torch.distributed import _symmetric_memory as symm_mem

    assert buffer is not None  # every rank allocated (agreed)
    symm_mem.rendezvous(buffer, name)
