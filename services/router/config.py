"""Router settings."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ContextConfig, opt, require
from services.common.lease import LeaseConfig
from services.common.server import ServerConfig
from services.common.tracing import TracingConfig
from services.router.policy import DEFAULT_PREFIX_CREDIT, POLICIES
from services.text.model.settings import ModelConfig

DECODE_STREAMS = ("step", "per-request")
"""Values of --decode-stream."""


@dataclass
class RouterConfig(ServerConfig, TracingConfig, ContextConfig, ModelConfig, LeaseConfig):
    port: int = opt(50051, "gRPC port of the Router API; 0 picks a free one.")
    http_host: str = opt("127.0.0.1", "Address the OpenAI-compatible HTTP API binds (0.0.0.0: every interface).")
    http_port: int = opt(8000, "HTTP port of the OpenAI-compatible API; 0 picks a free one.")
    prefill: str = opt("", "Prefill instances: comma-separated host:port, or dns:NAME:PORT for a headless "
                           "Service (all A records, refreshed). Empty: colocated mode (decode does both).")
    decode: str = opt("", "Decode (or colocated worker) instances, same syntax as --prefill.")
    served_model_name: str = opt("", "Model name clients send and /v1/models lists; empty: the model's id.")
    policy: str = opt("prefix_aware", "Instance selection policy.", choices=POLICIES)
    prefix_credit: float = opt(DEFAULT_PREFIX_CREDIT, "prefix_aware: load units (queued requests) a cached copy "
                                                      "of the whole prompt is worth; a shared system prompt wins "
                                                      "only until that instance has this many more requests than "
                                                      "another.")
    max_retries: int = opt(2, "Other instances tried per dispatch step when one is full or unreachable "
                              "(Reserve, Prefill); also the most migrations of one stream to another decode.")
    chunked_transfer: bool | None = opt(None, "Force chunked KV transfer on/off for every request; "
                                              "unset: each prefill's own default.")
    early_prefill: bool = opt(True, "P/D: send Prefill at the same time as decode's Reserve, without the "
                                    "reservation, and hand it over with AttachReservation once Reserve answered "
                                    "(prefill computes meanwhile, writes nothing before). Not done while decode "
                                    "answered Reserve with OVERLOADED in the last second.")
    decode_stream: str = opt("step", "How tokens come back from a decode or colocated worker: 'step', one long-lived "
                                     "stream per instance carrying every request's new tokens of an engine step "
                                     "in one message; 'per-request', one Decode.Generate stream per request.",
                             choices=DECODE_STREAMS)
    health_interval_s: float = opt(1.0, "Health and load polling period per instance (seconds).")
    dead_after_s: float = opt(10.0, "An instance is dead after this long without a SERVING health answer "
                                    "(seconds); a refused connection or NOT_SERVING is dead at once, a slow "
                                    "answer is not.")
    restart_wait_s: float = opt(60.0, "When no instance of a role is alive (its only prefill or decode died), "
                                      "a request waits up to this long, within its deadline, for one to come "
                                      "back (a supervisor's restart), probing every 0.25 s, instead of failing "
                                      "at once (seconds; 0: fail at once).")
    block_wait_s: float = opt(600.0, "A Reserve sent to the last decode left to try asks it to wait up to this "
                                     "long in all, within the request's deadline, for free KV blocks (its turn in "
                                     "arrival order) instead of refusing at once; the decode refuses sooner when "
                                     "its queue stalls (its --reserve-wait-s). Earlier tries do not wait, so a "
                                     "full decode passes the request on (seconds; 0: never).")
    resolve_interval_s: float = opt(10.0, "DNS re-resolution period for dns: targets (seconds).")
    request_timeout_s: float = opt(600.0, "Longest a request may run (seconds); a client's shorter deadline "
                                          "(HTTP header X-Request-Timeout, the gRPC deadline) wins.")
    max_body_bytes: int = opt(4 << 20, "Largest HTTP request body (bytes); larger answers 413.")
    max_inflight_requests: int = opt(1024, "Client requests the router admits at once (HTTP and gRPC together); "
                                           "past it HTTP 429 / gRPC RESOURCE_EXHAUSTED with a retry delay. The "
                                           "backends bound their own queues (prefill --max-queued, decode "
                                           "--max-pending); this bounds what the router itself holds, so it "
                                           "lets a GPU cluster's C512 burst reach them.")
    http_read_timeout_s: float = opt(30.0, "Longest wait for an HTTP request's head (then the connection is "
                                           "closed) or body (then 408), and idle keep-alive time (seconds).")
    api_key: str = opt("", "API key clients must send (HTTP 'Authorization: Bearer <key>', gRPC metadata "
                           "'authorization'); empty: no key. Prefer PDSERVE_API_KEY or --api-key-file over "
                           "the flag, which other users can read in the process list.")
    api_key_file: str = opt("", "File of accepted API keys, one per line ('#' comments); adds to --api-key.")
    access_log: bool = opt(True, "One INFO line per client request on the pdserve.access logger: id, status, "
                                 "tokens in/out, TTFT, e2e, finish reason.")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(bool(self.decode), self, "decode", "at least one decode instance is required")
        require(self.max_retries >= 0, self, "max_retries", f"must be >= 0, got {self.max_retries}")
        require(self.max_model_len >= 0, self, "max_model_len", f"must be >= 0, got {self.max_model_len}")
        require(self.lease_ms > 0, self, "lease_ms", f"must be > 0, got {self.lease_ms}")
        require(self.max_inflight_requests > 0, self, "max_inflight_requests",
                f"must be > 0, got {self.max_inflight_requests}")
        require(self.http_read_timeout_s > 0, self, "http_read_timeout_s",
                f"must be > 0, got {self.http_read_timeout_s}")
        require(self.request_timeout_s > 0, self, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        require(self.dead_after_s > 0, self, "dead_after_s", f"must be > 0, got {self.dead_after_s}")
        require(self.restart_wait_s >= 0, self, "restart_wait_s", f"must be >= 0, got {self.restart_wait_s}")
        require(self.block_wait_s >= 0, self, "block_wait_s", f"must be >= 0, got {self.block_wait_s}")
        require(self.prefix_credit >= 0, self, "prefix_credit", f"must be >= 0, got {self.prefix_credit}")

    @staticmethod
    def targets(value: str) -> list[str]:
        return [t.strip() for t in value.split(",") if t.strip()]
