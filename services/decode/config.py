"""Decode service settings (the engine's are EngineConfig's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt, require
from services.common.engine_core import EngineCoreConfig
from services.common.kv_mooncake import MooncakeTransportConfig
from services.common.lease import LeaseConfig
from services.common.server import ServerConfig
from services.common.tracing import TracingConfig


@dataclass
class DecodeConfig(ServerConfig, TracingConfig, LeaseConfig, MooncakeTransportConfig, EngineCoreConfig):
    port: int = opt(50062, "gRPC port; 0 picks a free one (reported in the ready line).")
    mode: str = opt("disaggregated", "disaggregated: KV comes from prefill; colocated: this service also "
                                     "prefills (the A/B baseline).", choices=("disaggregated", "colocated"))
    max_lease_ms: int = opt(300_000, "Longest lease a Reserve or RenewLease may ask for (ms); longer asks are "
                                     "capped to it. A lease never outlives the request's deadline either.")
    max_pending: int = opt(0, "Most requests admitted but not yet running (reservations whose KV has not "
                              "landed + requests queued in the engine); past it Reserve and colocated "
                              "Generate answer RESOURCE_EXHAUSTED (reason OVERLOADED). 0: the device's "
                              "default (256 on CPU, 1024 on CUDA).")
    overload_retry_after_ms: int = opt(1_000, "retry_after_ms suggested to callers refused as OVERLOADED (ms).")
    reserve_wait_s: float = opt(60.0, "Longest the Reserves waiting for free KV blocks (in arrival order, holding "
                                      "none) go without one of them getting its blocks: past it the queue has "
                                      "stalled (the pool is not turning over) and they answer RESOURCE_EXHAUSTED "
                                      "(seconds; 0: never wait). While it moves a Reserve waits as long as its "
                                      "caller asks (ReserveRequest.block_wait_ms: the router does when no other "
                                      "decode is left to try), within the call's and the request's deadlines. "
                                      "Waiting Reserves count against --max-pending.")
    kv_mooncake_host: str = opt("", "Register the KV pool with the Mooncake Transfer Engine at this address (the "
                                    "host prefills reach this decode at; TCP, RDMA where the NIC has it) and offer "
                                    "it to prefills (--kv-transport mooncake), instead of a same-host shm/CUDA IPC "
                                    "pool; empty: off.")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_mooncake()
        require(not (self.engine_core == "process" and self.kv_mooncake_host), self, "engine_core",
                "process: not with --kv-mooncake-host (the Mooncake transfer engine registers the pool in "
                "this process); use --engine-core thread")
        require(self.max_lease_ms > 0, self, "max_lease_ms", f"must be > 0, got {self.max_lease_ms}")
        require(0 < self.lease_ms <= self.max_lease_ms, self, "lease_ms",
                f"must be in (0, max_lease_ms={self.max_lease_ms}], got {self.lease_ms}")
        require(self.max_pending >= 0, self, "max_pending", f"must be >= 0, got {self.max_pending}")
        require(self.reserve_wait_s >= 0, self, "reserve_wait_s", f"must be >= 0, got {self.reserve_wait_s}")
        require(self.overload_retry_after_ms > 0, self, "overload_retry_after_ms",
                f"must be > 0, got {self.overload_retry_after_ms}")
