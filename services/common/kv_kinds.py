"""The kinds of KV pool a decode offers and the ``--kv-transport`` values: one table, read by name nowhere else.

A pool kind is a case of the ``pool`` oneof of ``KVDestination`` (and of ``DraftPool``): what a writer opens it
with, its id, whether it holds every KV head. A transport kind is a ``--kv-transport`` value and the flags it
implies for the decode and prefill a launcher starts together. The engine (shared_kv.py, parallel/rank_pages.py,
region_pools.py), decode and the launcher ask these entries; the connector registry (services/kv/registry.py) names
each connector's pool kind from here. Torch-free (protobuf messages only), so every package may import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PoolKind:
    """One case of the ``pool`` oneof: a way decode's KV pool is offered to writers."""

    case: str
    """The oneof case (a field of KVDestination / DraftPool)."""
    transport: str
    """The transport (``--kv-transport``, the connector's name) that writes a pool of this kind; "" for a
    ShardedPool (written over its rank pools' transport)."""
    ids: Callable[[Any], str] = field(repr=False, compare=False)
    """The pool id of a destination of this kind (``pool_id``)."""
    plain: bool = True
    """One pool holding every KV head (a ShardedPool's rank pools are plain)."""
    per_rank: bool = False
    """A tensor-parallel decode's ShardedPool: every rank's plain pool with the heads it holds."""
    mapped: bool = False
    """A same-host pool a prefill maps into its own process (shared_kv.SharedKVPools): a /dev/shm file or a CUDA
    IPC handle. A draft pool of a mapped kind is written beside the target pool by the same-host writer
    (engine/region_pools.py)."""
    shm_file: bool = False
    """The pool is the /dev/shm file ``shm.name`` (its inode tells a decode that went away)."""
    remote: bool = False
    """Registered with Mooncake transfer engines on decode's host and written over the network, never mapped; a
    draft pool of this kind sits on the target pool's transfer engines (region_pools.mooncake_region)."""

    def pool_id(self, dest: Any) -> str:
        """A short name for the pool ``dest`` (a destination of this kind) opens: what a writer's claim carries."""
        return self.ids(dest)


def _shm_id(dest: Any) -> str:
    return f"shm:{dest.shm.name}"


def _cuda_ipc_id(dest: Any) -> str:
    return f"cuda-ipc:{dest.cuda_ipc.device}:{hashlib.sha256(dest.cuda_ipc.handle).hexdigest()[:16]}"


def _mooncake_id(dest: Any) -> str:
    return f"mooncake:{dest.mooncake.segment}@{dest.mooncake.base_address:x}"


def _sharded_id(dest: Any) -> str:
    """A digest of every rank's pool id, named together."""
    ids = "|".join(pool_id(rp.pool) for rp in dest.sharded.ranks if pool_kind(rp.pool) is not SHARDED)
    return f"tp{dest.sharded.tp_size}:{hashlib.sha256(ids.encode()).hexdigest()[:16]}"


SHM = PoolKind("shm", "shm", _shm_id, mapped=True, shm_file=True)
CUDA_IPC = PoolKind("cuda_ipc", "cuda-ipc", _cuda_ipc_id, mapped=True)
MOONCAKE = PoolKind("mooncake", "mooncake", _mooncake_id, remote=True)
SHARDED = PoolKind("sharded", "", _sharded_id, plain=False, per_rank=True)
POOL_KINDS: tuple[PoolKind, ...] = (SHM, CUDA_IPC, MOONCAKE, SHARDED)
"""Every case of ``KVDestination.pool`` (``DraftPool.pool`` has the plain ones but sharded)."""
_BY_CASE: dict[str, PoolKind] = {k.case: k for k in POOL_KINDS}


def pool_kind(msg: Any) -> PoolKind | None:
    """The kind of pool a KVDestination (or a DraftPool) offers; None when it offers none."""
    return _BY_CASE.get(msg.WhichOneof("pool") or "")


def pool_id(dest: Any) -> str:
    """A short name for the pool a destination opens (what a writer's claim carries): the shm file name, the
    CUDA device and a digest of its IPC handle, the Mooncake segment and base address, or a digest of every
    rank's pool id (a tensor-parallel decode's ShardedPool); "" for none."""
    kind = pool_kind(dest)
    return kind.pool_id(dest) if kind is not None else ""


@dataclass(frozen=True)
class TransportKind:
    """One ``--kv-transport`` value (PrefillConfig's choices) and what it implies for the decode it writes to."""

    name: str
    shares_pool: bool = False
    """Decode keeps its pool where a same-host prefill can map it (``--kv-cache-shared``)."""
    mooncake_host: bool = False
    """Decode registers its pool with Mooncake transfer engines at a host and the prefill's engines bind it
    (``--kv-mooncake-host`` on both)."""

    def launch_args(self, host: str) -> tuple[list[str], list[str]]:
        """(prefill flags, decode flags) a launcher gives the two sides (``host``: where Mooncake binds)."""
        prefill = ["--kv-transport", self.name]
        if self.mooncake_host:
            return [*prefill, "--kv-mooncake-host", host], ["--kv-mooncake-host", host]
        if self.shares_pool:
            return prefill, ["--kv-cache-shared"]
        return prefill, []


TRANSPORTS: tuple[TransportKind, ...] = (
    TransportKind("grpc"),  # page bytes inside the PushKV stream, anywhere
    TransportKind(SHM.transport, shares_pool=True),
    TransportKind(CUDA_IPC.transport, shares_pool=True),
    TransportKind(MOONCAKE.transport, mooncake_host=True),
    TransportKind("auto", shares_pool=True),  # whichever side transport decode offers (shm on CPU, cuda-ipc on GPU)
)
TRANSPORT_NAMES: tuple[str, ...] = tuple(t.name for t in TRANSPORTS)
AUTO = TRANSPORTS[-1]
_BY_NAME: dict[str, TransportKind] = {t.name: t for t in TRANSPORTS}


def transport_kind(name: str) -> TransportKind | None:
    """The ``--kv-transport`` value ``name``; None for one that is not."""
    return _BY_NAME.get(name)
