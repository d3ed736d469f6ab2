"""The process group of one tensor-parallel instance, and the group a model is being built for.

Ranks meet through a TCPStore on 127.0.0.1 (rank 0 binds port 0, so the OS picks a free port) and talk
through gloo (CPU) or NCCL (CUDA) bound to loopback. Collectives go through the ProcessGroup object
itself: no default global group, so one process may hold several groups (tests) and nothing leaks.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist

from services.engine.parallel.fast_allreduce import OneShotAllReduce, forbid_multicast, setup

LOOPBACK = "127.0.0.1"
COLLECTIVE_TIMEOUT_S = 120.0
"""The group's bound on one collective and one store call (seconds); rank 0 waits as long for a rank's
acknowledgement of a chunk's page writes (rank_writes.py) before it takes the rank as dead."""


class TPGroup:
    """rank/size plus the collectives the model and the step loop use. size 1: every op is the identity."""

    def __init__(self, rank: int, size: int, pg: dist.ProcessGroup | None = None,
                 store: dist.Store | None = None, device: torch.device | None = None) -> None:
        self.rank, self.size, self.pg = rank, size, pg
        self.device = device or torch.device("cpu")
        """Where this rank's collectives run (NCCL needs CUDA tensors)."""
        self.store = store
        """Kept alive as long as the group (rank 0's TCPStore serves the others)."""
        self.fast: OneShotAllReduce | None = None
        """The one-shot P2P all-reduce for small CUDA tensors (fast_allreduce.py); None: NCCL / gloo only."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns x. Small CUDA tensors take the one-shot path when the group
        has one (the same choice on every rank: it depends on x's shape, dtype and alignment)."""
        if self.size > 1:
            if self.fast is not None and self.fast.fits(x):
                return self.fast(x)
            assert self.pg is not None
            self.pg.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (rank order)."""
        if self.size == 1:
            return x
        assert self.pg is not None
        x = x.contiguous()
        if x.is_cuda:  # NCCL all_gather_into_tensor: one flat output, no list copies (captured in decode graphs)
            flat = x.new_empty((self.size, *x.shape))
            self.pg._allgather_base(flat, x).wait()
            return torch.cat(flat.unbind(0), dim=-1)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.pg.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        """x from root into every rank's x (same shape and dtype everywhere), in place."""
        if self.size > 1:
            assert self.pg is not None
            self.pg.broadcast(x, root).wait()
        return x

    def gather_to_root(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Rank 0 gets every rank's x (same shape everywhere), others get []."""
        if self.size == 1:
            return [x]
        assert self.pg is not None
        x = x.contiguous()
        outs = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else []
        self.pg.gather(outs, x, 0).wait()
        return outs


    def scatter_from_root(self, out: torch.Tensor, parts: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank r receives rank 0's parts[r] into out (parts: rank 0 only, one per rank, out's shape)."""
        if self.size == 1:
            assert parts is not None
            return out.copy_(parts[0])
        assert self.pg is not None
        self.pg.scatter(out, [p.contiguous() for p in parts] if self.rank == 0 and parts else [], 0).wait()
        return out


def open_store(size: int, port: int = 0, *, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0 (port 0: a free port, read it back from ``.port``) or a peer (rank 0's port)."""
    return dist.TCPStore(LOOPBACK, port, size, is_master=port == 0, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect(store: dist.Store, rank: int, size: int, device: torch.device, *, timeout_s: float = COLLECTIVE_TIMEOUT_S,
            fast_allreduce: bool = True) -> TPGroup:
    """Join the group (every rank calls this, with the same ``fast_allreduce``; returns when all have).
    On CUDA with ``fast_allreduce`` small all-reduces go one-shot over P2P (fast_allreduce.py) when every
    rank can; NVLink multicast is off either way."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        forbid_multicast()
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg: dist.ProcessGroup = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        gopts = dist.ProcessGroupGloo._Options()
        gopts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        gopts._timeout = timeout
        pg = dist.ProcessGroupGloo(store, rank, size, gopts)
    group = TPGroup(rank, size, pg, store, device)
    group.all_reduce(torch.zeros(1, device=device))  # every rank connected
    if device.type == "cuda" and fast_allreduce and size > 1:
        group.fast = setup(pg, store, rank, size, device)
    return group


_building: TPGroup | None = None


@contextlib.contextmanager
def building(group: TPGroup | None) -> Iterator[None]:
    """Models constructed inside are sharded for ``group`` (None or size 1: plain modules)."""
    global _building
    prev, _building = _building, group
    try:
        yield
    finally:
        _building = prev


def building_group() -> TPGroup | None:
    """The group of the model under construction; None outside :func:`building` (TP=1)."""
    return _building if _building is not None and _building.size > 1 else None
