"""Prefill service settings (the engine's are EngineConfig's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt, require
from services.common.engine_core import EngineCoreConfig
from services.common.kv_kinds import TRANSPORT_NAMES
from services.common.kv_mooncake import MooncakeTransportConfig
from services.common.server import ServerConfig
from services.common.tracing import TracingConfig

KVSTORE_WRITE_BACK_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
"""``--kvstore-write-back-bytes 0``, by device: a GPU prefill's ring holds eight 128 MiB write-backs (a 1024-token
prompt of an 8B Llama in bf16; ``--kvstore-max-pending-writes``' default), a CPU prefill's models are smaller."""


@dataclass
class PrefillConfig(ServerConfig, TracingConfig, MooncakeTransportConfig, EngineCoreConfig):
    port: int = opt(50061, "gRPC port; 0 picks a free one (reported in the ready line).")
    chunked_transfer: bool = opt(True, "Send each chunk's KV pages as soon as the chunk is computed (on), or "
                                       "everything after the last chunk (off: the A/B baseline). A request "
                                       "may override it.")
    kv_transport: str = opt("grpc", "How page bytes travel to decode: grpc (inside the PushKV stream, works "
                                    "everywhere), shm (CPU) or cuda-ipc (GPU): written straight into the pool of "
                                    "a decode on this host started with --kv-cache-shared; mooncake: written by "
                                    "the Mooncake Transfer Engine into the pool of a decode (any host) started "
                                    "with --kv-mooncake-host; auto: whichever of these the decode offers. Falls "
                                    "back to grpc (counted, logged once) when the decode offers none.",
                            choices=TRANSPORT_NAMES)
    kv_mooncake_host: str = opt("127.0.0.1", "Address this prefill's Mooncake Transfer Engine binds and is "
                                             "reached at (--kv-transport mooncake/auto).")
    kv_mooncake_staging_bytes: int = opt(2 << 30, "Pinned host staging a GPU prefill registers with Mooncake "
                                                   "(bytes; made on first use): chunk pages are copied there, then "
                                                   "written into a GPU decode's host landing area. A prompt whose KV "
                                                   "is larger goes by grpc (counted, logged once).")
    kv_wire_codec: str = opt("native", "Codec of KV pages sent to decode (bytes in the stream, or mooncake through "
                                       "host staging; shm / cuda-ipc write the cache's dtype): native (the cache's "
                                       "dtype) or fp8-e4m3 (per-token-per-head scales; about half of bf16's bytes, "
                                       "decoded on arrival; used only when the decode accepts it).",
                             choices=("native", "fp8-e4m3"))
    kvstore_address: str = opt("", "kvstore host:port for cross-instance prefix reuse; empty: none.")
    kvstore_write_back: bool = opt(True, "Write newly computed full pages to the kvstore (asynchronously).")
    kvstore_timeout_s: float = opt(2.0, "Longest wait for one kvstore Lookup or Get (seconds); past it the "
                                        "request computes its prefix instead.")
    kvstore_retry_s: float = opt(1.0, "After the kvstore failed to answer, skip it for this long (seconds) so "
                                      "no request waits on a store that is down; then try again.")
    kvstore_max_pending_writes: int = opt(8, "Background kvstore write-backs under way at once (count); more are "
                                             "dropped (counted), bounding the host memory they hold.")
    kvstore_write_back_bytes: int = opt(0, "Shared-memory ring through which write-back pages go to this prefill's "
                                           "kvstore writer process (bytes; a /dev/shm file, page-locked on CUDA, "
                                           "allocated at start): a write-back that finds no room in it is dropped "
                                           "(counted). 0: 1 GiB on CUDA (eight 128 MiB write-backs, a 1024-token "
                                           "prompt of an 8B Llama in bf16 each), 256 MiB on CPU.")
    claim_wait_s: float = opt(30.0, "Longest a request whose prompt is computed waits for decode to acknowledge a "
                                    "side transport's claim (seconds; its KV blocks stay held meanwhile, no other "
                                    "request waits). Past it the request fails UNAVAILABLE, retryable: the router "
                                    "retries it with the same reservation.")
    max_queued: int = opt(0, "Prefill requests admitted and not finished (count); past it Prefill answers "
                             "RESOURCE_EXHAUSTED (reason OVERLOADED, with a retry-after hint). 0: the "
                             "device's default (64 on CPU, 1024 on CUDA).")
    slowdown_ms_per_chunk: int = opt(0, "Testing aid: sleep this long after each computed chunk (simulates a "
                                        "slower prefill device). 0 in production.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_mooncake()
        require(self.claim_wait_s > 0, self, "claim_wait_s", f"must be > 0, got {self.claim_wait_s}")
        require(self.max_queued >= 0, self, "max_queued", f"must be >= 0, got {self.max_queued}")
        require(self.kv_mooncake_staging_bytes > 0, self, "kv_mooncake_staging_bytes",
                f"must be > 0, got {self.kv_mooncake_staging_bytes}")
        require(self.kvstore_timeout_s > 0, self, "kvstore_timeout_s", f"must be > 0, got {self.kvstore_timeout_s}")
        require(self.kvstore_retry_s >= 0, self, "kvstore_retry_s", f"must be >= 0, got {self.kvstore_retry_s}")
        require(self.kvstore_max_pending_writes > 0, self, "kvstore_max_pending_writes",
                f"must be > 0, got {self.kvstore_max_pending_writes}")
        require(self.kvstore_write_back_bytes >= 0, self, "kvstore_write_back_bytes",
                f"must be >= 0 (0: the device's default), got {self.kvstore_write_back_bytes}")
        require(self.slowdown_ms_per_chunk >= 0, self, "slowdown_ms_per_chunk",
                f"must be >= 0, got {self.slowdown_ms_per_chunk}")

    def write_back_bytes(self, device_type: str) -> int:
        """The kvstore write-back ring's size on a ``device_type`` ("cuda", "cpu") engine."""
        return self.kvstore_write_back_bytes or KVSTORE_WRITE_BACK_BYTES.get(device_type, KVSTORE_WRITE_BACK_BYTES["cpu"])
