"""Prefill service settings (the engine's are EngineConfig's)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import opt
from services.common.server import ServerConfig


@dataclass
class PrefillConfig(ServerConfig):
    port: int = opt(50061, "gRPC port; 0 picks a free one (reported in the ready line).")
    chunked_transfer: bool = opt(True, "Send each chunk's KV pages as soon as the chunk is computed (on), or "
                                       "everything after the last chunk (off: the A/B baseline). A request "
                                       "may override it.")
    kv_transport: str = opt("grpc", "How page bytes travel to decode: grpc (inside the PushKV stream, works "
                                    "everywhere), shm (CPU) or cuda-ipc (GPU): written straight into the pool of "
                                    "a decode on this host started with --kv-cache-shared; grpc otherwise.",
                            choices=("grpc", "shm", "cuda-ipc"))
    kv_wire_codec: str = opt("native", "Codec of page bytes sent in the stream: native (the cache's dtype) or "
                                       "fp8-e4m3 (per-token-per-head scales; about half of bf16's bytes, decoded "
                                       "on arrival; used only when the decode accepts it).",
                             choices=("native", "fp8-e4m3"))
    kvstore_address: str = opt("", "kvstore host:port for cross-instance prefix reuse; empty: none.")
    kvstore_write_back: bool = opt(True, "Write newly computed full pages to the kvstore (asynchronously).")
    tracing: str = opt("none", "OpenTelemetry exporter: none, console, otlp.", choices=("none", "console", "otlp"))
    otlp_endpoint: str = opt("", "OTLP collector endpoint when --tracing otlp.")
    slowdown_ms_per_chunk: int = opt(0, "Testing aid: sleep this long after each computed chunk (simulates a "
                                        "slower prefill device). 0 in production.")
