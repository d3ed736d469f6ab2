"""kvstore service settings: one dataclass, flags with PDSERVE_KVSTORE_* env fallbacks."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt, require
from services.common.grpc_util import MiB, payload_budget
from services.common.server import ServerConfig

GiB = 1 << 30
BACKENDS = ("embedded", "mooncake")


def _env(name: str) -> str:
    return "PDSERVE_KVSTORE_" + name.upper()


@dataclass
class KVStoreConfig(ServerConfig):
    """kvstore: content-addressed KV pages (embedded memory+disk tiers, or a Mooncake Store cluster)."""

    backend: str = opt("embedded", "Storage backend.", choices=BACKENDS, env=_env("backend"))
    memory_bytes: int = opt(2 * GiB, "embedded: memory tier budget (bytes); 0 disables the tier.",
                            env=_env("memory_bytes"))
    disk_dir: str | None = opt(None, "embedded: directory of the disk tier; none: memory only.",
                               env=_env("disk_dir"))
    disk_bytes: int = opt(16 * GiB, "embedded: disk tier budget (bytes, page files including headers).",
                          env=_env("disk_bytes"))
    max_page_bytes: int = opt(64 * MiB, "Largest page accepted by Put (bytes); larger ones get RESOURCE_EXHAUSTED.",
                              env=_env("max_page_bytes"))
    piece_bytes: int = opt(4 * MiB, "Payload bytes per Page message when streaming a page (bytes).",
                           env=_env("piece_bytes"))
    max_inflight_put_bytes: int = opt(256 * MiB, "Most page bytes all open Put streams together may be assembling "
                                      "(bytes, counted as each page announces its total_size); past it Put "
                                      "answers RESOURCE_EXHAUSTED.", env=_env("max_inflight_put_bytes"))
    put_idle_timeout_s: float = opt(30.0, "A Put stream sending no piece for this long is ended (seconds); it "
                                          "frees the quota its unfinished page holds.",
                                    env=_env("put_idle_timeout_s"))
    mooncake_master: str = opt("127.0.0.1:50051", "mooncake: master RPC address host:port.",
                               env=_env("mooncake_master"))
    mooncake_local_hostname: str = opt("127.0.0.1", "mooncake: address other Mooncake clients reach us at.",
                                       env=_env("mooncake_local_hostname"))
    mooncake_metadata_server: str = opt("P2PHANDSHAKE", "mooncake: transfer-engine metadata server "
                                        "(P2PHANDSHAKE: none needed).", env=_env("mooncake_metadata_server"))
    mooncake_segment_bytes: int = opt(2 * GiB, "mooncake: memory this process contributes to the cluster (bytes).",
                                      env=_env("mooncake_segment_bytes"))
    mooncake_buffer_bytes: int = opt(256 * MiB, "mooncake: client staging buffer (bytes); > max page + 64.",
                                     env=_env("mooncake_buffer_bytes"))
    mooncake_protocol: str = opt("tcp", "mooncake: transfer protocol.", choices=("tcp", "rdma"),
                                 env=_env("mooncake_protocol"))
    mooncake_device: str = opt("", "mooncake: RDMA device names (empty for tcp).", env=_env("mooncake_device"))
    mooncake_op_timeout_s: float = opt(5.0, "mooncake: longest wait for one store call (seconds).",
                                       env=_env("mooncake_op_timeout_s"))

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.memory_bytes >= 0, self, "memory_bytes", f"must be >= 0, got {self.memory_bytes}")
        require(self.disk_bytes >= 0, self, "disk_bytes", f"must be >= 0, got {self.disk_bytes}")
        require(self.max_page_bytes > 0, self, "max_page_bytes", f"must be > 0, got {self.max_page_bytes}")
        require(self.max_inflight_put_bytes >= self.max_page_bytes, self, "max_inflight_put_bytes",
                f"must be >= --max-page-bytes ({self.max_page_bytes}), got {self.max_inflight_put_bytes}")
        require(self.put_idle_timeout_s > 0, self, "put_idle_timeout_s", f"must be > 0, got {self.put_idle_timeout_s}")
        require(0 < self.piece_bytes <= payload_budget(self.max_message_bytes), self, "piece_bytes",
                f"must be in (0, {payload_budget(self.max_message_bytes)}] to fit a "
                f"{self.max_message_bytes}-byte message (--max-message-bytes), got {self.piece_bytes}")
        if self.backend == "embedded":
            largest = max(self.memory_bytes, self.disk_bytes if self.disk_dir else 0)
            require(largest > 0, self, "memory_bytes",
                    "is 0 and no --disk-dir / PDSERVE_KVSTORE_DISK_DIR is set: the store could hold nothing")
        else:
            require(self.mooncake_buffer_bytes > self.max_page_bytes, self, "mooncake_buffer_bytes",
                    f"must exceed --max-page-bytes ({self.max_page_bytes}), got {self.mooncake_buffer_bytes}")
            require(self.mooncake_op_timeout_s > 0, self, "mooncake_op_timeout_s",
                    f"must be > 0, got {self.mooncake_op_timeout_s}")

