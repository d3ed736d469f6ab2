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

import logging
import os
import uuid

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ONE_SHOT_MAX_BYTES = 4 << 20
"""Largest all-reduce (bytes) that takes the one-shot path; above it NCCL (ring/tree) wins because every
rank reads every peer's whole tensor. 4 MiB covers the decode steps up to batch 512 of a 4096-wide model in
bf16; a prefill chunk of 8192 x 4096 bf16 (64 MiB) stays on NCCL. Measured: docs/PERFORMANCE.md, "GPU,
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


def _agree(pg: dist.ProcessGroup, ok: bool, device: torch.device) -> bool:
    """True when every rank says ok (one NCCL all-reduce)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    pg.allreduce([flag]).wait()
    return int(flag.item()) == pg.size()


def _peers_reachable(pg: dist.ProcessGroup, device: torch.device) -> bool:
    mine = torch.tensor([device.index], dtype=torch.int64, device=device)
    every = mine.new_empty(pg.size())
    pg._allgather_base(every, mine).wait()
    return all(torch.cuda.can_device_access_peer(device, int(d)) for d in every.tolist() if int(d) != device.index)


def setup(pg: dist.ProcessGroup, store: dist.Store, rank: int, size: int, device: torch.device,
          max_bytes: int = ONE_SHOT_MAX_BYTES) -> OneShotAllReduce | None:
    """Collective (every rank of a CUDA group calls it after NCCL is up): the fast path, or None on every
    rank when any rank lacks symmetric memory or a peer is not P2P-reachable (the reason is logged)."""
    why, fused = "", False
    try:
        from torch._C._distributed_c10d import _SymmetricMemory
        from torch.distributed import _symmetric_memory as symm_mem

        fused = hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out")
        if not fused and not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
            why = "this torch has no symm_mem.one_shot_all_reduce_out"
    except Exception as e:  # any failure means NCCL only, on every rank
        why = f"no symmetric memory in this torch ({e!r})"
    with torch.cuda.device(device):
        if not why and not _peers_reachable(pg, device):
            why = "a peer GPU is not P2P-reachable from this one"
        if not _agree(pg, not why, device):
            log.warning("one-shot all-reduce off (NCCL only): %s", why or "another rank cannot use it")
            return None
        if rank == 0:
            store.set("pdserve/symm_mem_group", f"pdserve-tp-{uuid.uuid4().hex}")
        name = store.get("pdserve/symm_mem_group").decode()
        buffer: torch.Tensor | None = None
        try:
            try:
                symm_mem.set_backend("CUDA")  # peer mappings over cuMem/IPC; never NVSHMEM
            except Exception as e:  # already chosen in this process (an earlier group)
                log.debug("symmetric memory backend not set: %r", e)
            _SymmetricMemory.set_group_info(name, rank, size, dist.PrefixStore(name, store))
            buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        except Exception as e:  # any failure means NCCL only, on every rank
            why, buffer = f"symmetric memory allocation failed: {e!r}", None
            log.warning("rank %d: %s", rank, why, exc_info=True)
        # Local steps agreed before the collective one, so a rank that failed above never leaves its peers
        # waiting in the rendezvous's store exchange.
        if not _agree(pg, buffer is not None, device):
            log.warning("one-shot all-reduce off (NCCL only): %s", why or "another rank failed its allocation")
            return None
        assert buffer is not None  # every rank allocated, this one included
        try:
            symm_mem.rendezvous(buffer, name)
        except Exception as e:  # any failure means NCCL only, on every rank
            why, buffer = f"symmetric memory rendezvous failed: {e!r}", None
            log.warning("rank %d: %s", rank, why, exc_info=True)
        if not _agree(pg, buffer is not None, device):
            log.warning("one-shot all-reduce off (NCCL only): %s", why or "another rank failed its setup")
            return None
    assert buffer is not None
    log.info("one-shot all-reduce on for tensors up to %d bytes (symmetric memory group %s, %s)", max_bytes, name,
             "one_shot_all_reduce_copy_out" if fused else "copy + one_shot_all_reduce_out")
    return OneShotAllReduce(name, buffer, max_bytes, fused)
