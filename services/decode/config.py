"""Decode service settings (the engine's are EngineConfig's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt, require
from services.common.server import ServerConfig


@dataclass
class DecodeConfig(ServerConfig):
    port: int = opt(50062, "gRPC port; 0 picks a free one (reported in the ready line).")
    mode: str = opt("disaggregated", "disaggregated: KV comes from prefill; colocated: this service also "
                                     "prefills (the A/B baseline).", choices=("disaggregated", "colocated"))
    lease_ms: int = opt(30_000, "How long a reservation waits for its KV before its blocks are freed (ms), "
                                "unless the Reserve call asks for another lease.")
    tracing: str = opt("none", "OpenTelemetry exporter: none, console, otlp.", choices=("none", "console", "otlp"))
    otlp_endpoint: str = opt("", "OTLP collector endpoint when --tracing otlp.")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.lease_ms > 0, self, "lease_ms", f"must be > 0, got {self.lease_ms}")
