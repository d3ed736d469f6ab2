"""The connector registry: every way KV pages travel, by name and by the kind of pool decode offers.

The only place transport names are compared: elsewhere the tree asks a connector's flags
(``writes_pages_itself``, ``overlaps_compute``, ``needs_host_staging``, ``crosses_hosts``) or a ``Mode``'s. The
pool kinds and ``--kv-transport`` values themselves are one table, services/common/kv_kinds.py (torch-free, so
the engine, decode and the launcher read it too): each connector names its pool kind from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common import kv_kinds
from services.common.pb import decode_pb2
from services.engine.parallel.rank_pages import transport_of
from services.kv.byte_stream import FAKE, GRPC
from services.kv.connector import Connector
from services.kv.mooncake import MOONCAKE, MOONCAKE_STAGED
from services.kv.shards import SHARDS
from services.kv.shared_pool import CUDA_IPC, SHM

CONNECTORS: tuple[Connector, ...] = (GRPC, SHM, CUDA_IPC, MOONCAKE, MOONCAKE_STAGED, SHARDS, FAKE)
"""Every registered connector (mooncake has two: direct and staged, one name on the wire)."""
BY_NAME: dict[str, Connector] = {c.name: c for c in (GRPC, SHM, CUDA_IPC, MOONCAKE, FAKE)}
"""Transport name (``--kv-transport``, ``KVChunk.transport``) -> its connector (mooncake: the direct one)."""
IN_PLACE: dict[str, Connector] = {n: c for n, c in BY_NAME.items() if c.writes_pages_itself}
"""Transports that write pages into decode's pool themselves; their chunks carry descriptors only."""
AUTO = kv_kinds.AUTO.name
"""``--kv-transport auto``: whichever side transport decode offers."""
DEFAULT = GRPC
"""The transport a chunk naming none went by (bytes in the stream)."""
_BY_POOL: dict[kv_kinds.PoolKind, Connector] = {c.pool: c for c in (SHM, CUDA_IPC, MOONCAKE) if c.pool is not None}


def by_name(name: str) -> Connector | None:
    return BY_NAME.get(name)


def label(name: str) -> str:
    """A received chunk's transport as a metric label (none named: the byte stream)."""
    return name or DEFAULT.name


def writes_in_place(name: str) -> bool:
    """Whether chunks naming transport ``name`` carry descriptors only (their pages written in place)."""
    return name in IN_PLACE


def for_destination(dest: decode_pb2.KVDestination, ranks: bool) -> tuple[Connector | None, Connector | None]:
    """(connector that writes ``dest``, the transport it writes over) for a prefill: ``ranks`` (rank-to-rank
    writes apply) -> (SHARDS, the transport of the rank pools); a Mooncake landing area -> the staged
    connector; (None, None) when no registered connector writes it."""
    if ranks:
        over = BY_NAME.get(transport_of(dest))
        return (SHARDS, over) if over is not None else (None, None)
    kind = kv_kinds.pool_kind(dest)
    c = _BY_POOL.get(kind) if kind is not None else None
    if c is MOONCAKE and dest.mooncake.page_major:
        return MOONCAKE_STAGED, MOONCAKE
    return c, c


@dataclass(frozen=True)
class Mode:
    """A prefill's ``--kv-transport``: which connectors it may write through."""

    name: str

    @property
    def bytes_only(self) -> bool:
        """Never writes into decode's pool (grpc)."""
        return self.name == GRPC.name

    def takes(self, over: Connector) -> bool:
        """Whether this mode writes through ``over`` (a transport's connector) when decode offers it."""
        return self.name == AUTO or over.name == self.name

    @property
    def overlaps_compute(self) -> bool:
        """Every writer this mode makes overlaps compute (decides tail cuts and layer-group export before a
        request's writer exists)."""
        c = BY_NAME.get(self.name)
        return c is not None and c.overlaps_compute
