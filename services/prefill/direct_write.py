"""Same-host direct writes (``--kv-transport shm`` / ``cuda-ipc``): pages copied straight into the
reserved blocks of decode's pool, the PushKV stream carrying descriptors only.

The destination is the typed ``KVDestination`` decode issued with the reservation (see
services/engine/shared_kv.py for what is checked before a pool is opened). When it cannot be used
(decode offers none, another host, a file that fails a check, a pool of another shape) the request
falls back to page bytes in the stream: counted per (transport, reason) and logged once for each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import torch

from services.common.metrics import PrefillMetrics
from services.common.pb import prefill_pb2
from services.engine.shared_kv import SharedKVAttachError, SharedKVPools, copy_pages

log = logging.getLogger(__name__)

DirectWriter = Callable[[int, list[int]], None]
"""``write(first_block, src_block_ids)``: copy pages into the reservation's blocks from first_block on
(runs on the engine thread)."""

ONEOF_OF = {"shm": "shm", "cuda-ipc": "cuda_ipc"}
"""--kv-transport -> the KVDestination.pool case it writes into."""


class InvalidDestinationError(ValueError):
    """The request's destination block ids do not fit the decode pool it names (INVALID_ARGUMENT)."""


class DirectWrites:
    def __init__(self, mode: str, metrics: PrefillMetrics) -> None:
        self.mode = mode
        """The configured transport: grpc (never writes directly), shm or cuda-ipc."""
        self.metrics = metrics
        self.pools = SharedKVPools()
        self._lock = threading.Lock()  # attach() runs in worker threads
        self._logged: set[tuple[str, str]] = set()

    def _fallback(self, reason: str, message: str) -> None:
        self.metrics.kv_transport_fallbacks_total.labels(self.mode, reason).inc()
        if (self.mode, reason) not in self._logged:
            self._logged.add((self.mode, reason))
            log.warning("%s transport refused (%s): %s; sending page bytes in the stream (logged once per reason)",
                        self.mode, reason, message)

    def _attach(self, request: prefill_pb2.PrefillRequest) -> torch.Tensor:
        with self._lock:
            return self.pools.attach(request.destination)

    async def writer(self, request: prefill_pb2.PrefillRequest, src: torch.Tensor, num_blocks: int
                     ) -> DirectWriter | None:
        """A writer into the request's reserved blocks, or None (page bytes go in the stream).

        ``src`` is this prefill's KV cache; ``num_blocks`` the prompt's block count, which the request's
        dest_block_ids must match. Raises InvalidDestinationError for block ids outside decode's pool."""
        if self.mode == "grpc":
            return None
        offered = request.destination.WhichOneof("pool")
        if offered != ONEOF_OF[self.mode]:
            self._fallback("none", f"the decode offers {offered or 'no shared pool'}")
            return None
        dest = list(request.dest_block_ids)
        if len(dest) != num_blocks:
            self._fallback("blocks", f"{len(dest)} destination block ids for a {num_blocks}-block prompt")
            return None
        try:
            pool = await asyncio.to_thread(self._attach, request)
        except SharedKVAttachError as e:
            self._fallback(e.reason, str(e))
            return None
        if pool.shape[:2] != src.shape[:2] or pool.shape[3:] != src.shape[3:] or pool.dtype != src.dtype:
            self._fallback("shape", f"decode's pool is {tuple(pool.shape)} {pool.dtype}, this cache "
                                    f"{tuple(src.shape)} {src.dtype}")
            return None  # the fingerprint check would refuse the pages; never reinterpret them
        bad = next((b for b in dest if b >= pool.shape[2]), None)
        if bad is not None:
            raise InvalidDestinationError(f"block {bad} is outside the decode pool's {pool.shape[2]} blocks")

        def write(first_block: int, src_blocks: list[int]) -> None:
            if first_block + len(src_blocks) > len(dest):
                raise ValueError(f"pages [{first_block}, {first_block + len(src_blocks)}) outside the "
                                 f"{len(dest)} reserved blocks")
            copy_pages(src, src_blocks, pool, dest[first_block:first_block + len(src_blocks)])
            if src.is_cuda:  # the pages must have landed before the descriptor tells decode they have
                torch.cuda.current_stream(src.device).synchronize()

        return write
