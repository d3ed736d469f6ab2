"""Every Prometheus metric pdserve exports, named in one place (docs/METRICS.md).

Each service builds its group against a `CollectorRegistry` it is handed, so tests and several
in-process servers never collide on the global registry:

    registry = CollectorRegistry()
    m = DecodeMetrics(registry)
    m.kv_wait_seconds.labels(model="smollm2-135m").observe(0.042)
    port = start_metrics_server(registry, "127.0.0.1", 0)

Names follow Prometheus conventions: `pdserve_<service>_` prefix, histograms in `_seconds`, counters
end in `_total`, byte counts in `_bytes` (`_bytes_total` for counters). The NAME constants below are what
the Grafana dashboards (deploy/grafana/build_dashboards.py) and docs/METRICS.md refer to; `SPECS`
carries type, labels and help for each. Timers are observed in seconds from `time.monotonic()`
differences, except the exposed KV transfer, which spans two hosts (see docs/METRICS.md).

Label values (small, closed sets; never request ids or prompts):
    model          served model id
    status         ok | error | cancelled   (cancelled: the client went away)
    finish_reason  stop | length (status ok) | error | cancelled
    code           lower-case gRPC status name, whichever API failed (HTTP 400 -> invalid_argument,
                   401 -> unauthenticated, 429 -> resource_exhausted, 503 -> unavailable, 504 -> deadline_exceeded)
    role           prefill | decode | kvstore
    endpoint       host:port of a backend as the router sees it (not `instance`: Prometheus owns that)
    reason         short snake_case cause, e.g. fingerprint, checksum, order, size, unavailable
    source         local | kvstore   (where a cached prefix came from)
    transport      grpc | shm | cuda-ipc | mooncake
    tier           memory | disk | mooncake
    outcome        ok | failed   (router migrations)
    phase          a point of a P/D handoff (the *_handoff_phase_seconds help lists them)
    cuda_graph     graphed | eager   (engine steps)
    dtype, dtype_reason, device, cpu_model, cpu_threads, weight_format, weight_format_reason
                                                          (engine info gauges only: one series per process)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest, start_http_server
from prometheus_client.metrics import MetricWrapperBase

MetricKind = Literal["counter", "gauge", "histogram"]

# Request-level latencies: 1 ms .. 600 s; 13 buckets below 1 s, and past 60 s for CPU and overloaded
# deployments (a p90 above the top finite bucket reads as that bucket).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
    90.0, 120.0, 180.0, 240.0, 300.0, 450.0, 600.0,
)
# Phases of one P/D handoff: 100 us .. 600 s (on one host most phases take well under 1 ms).
PHASE_BUCKETS: tuple[float, ...] = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS)
# Tokens per speculative verify step (accepted drafts + 1): 1 .. 16.
SPEC_LENGTH_BUCKETS: tuple[float, ...] = tuple(float(n) for n in range(1, 17))
# Per-token gaps (ITL, TPOT): denser below 200 ms, still reaching 300 s for stalls.
TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
# Tokens or sequences in one engine step: 1 .. 65536, powers of two.
STEP_COUNT_BUCKETS: tuple[float, ...] = tuple(float(2 ** n) for n in range(17))

# --- router -------------------------------------------------------------------------------------
ROUTER_TTFT_SECONDS = "pdserve_router_time_to_first_token_seconds"
ROUTER_ITL_SECONDS = "pdserve_router_inter_token_latency_seconds"
ROUTER_E2E_SECONDS = "pdserve_router_e2e_request_latency_seconds"
ROUTER_REQUESTS_TOTAL = "pdserve_router_requests_total"
ROUTER_PROMPT_TOKENS_TOTAL = "pdserve_router_prompt_tokens_total"
ROUTER_GENERATION_TOKENS_TOTAL = "pdserve_router_generation_tokens_total"
ROUTER_ERRORS_TOTAL = "pdserve_router_errors_total"
ROUTER_DISPATCH_RETRIES_TOTAL = "pdserve_router_dispatch_retries_total"
ROUTER_INFLIGHT_REQUESTS = "pdserve_router_inflight_requests"
ROUTER_INSTANCE_HEALTHY = "pdserve_router_instance_healthy"
ROUTER_MIGRATIONS_TOTAL = "pdserve_router_migrations_total"
ROUTER_INSTANCE_WAITS_TOTAL = "pdserve_router_instance_waits_total"
ROUTER_HANDOFF_PHASE_SECONDS = "pdserve_router_handoff_phase_seconds"

# --- prefill ------------------------------------------------------------------------------------
PREFILL_QUEUE_SECONDS = "pdserve_prefill_queue_seconds"
PREFILL_COMPUTE_SECONDS = "pdserve_prefill_compute_seconds"
PREFILL_CHUNKS_TOTAL = "pdserve_prefill_chunks_total"
PREFILL_COMPUTED_TOKENS_TOTAL = "pdserve_prefill_computed_tokens_total"
PREFILL_CACHED_PREFIX_TOKENS_TOTAL = "pdserve_prefill_cached_prefix_tokens_total"
PREFILL_KV_SKIPPED_TOKENS_TOTAL = "pdserve_prefill_kv_skipped_tokens_total"
PREFILL_KV_SENT_BYTES_TOTAL = "pdserve_prefill_kv_sent_bytes_total"
PREFILL_KV_CHUNKS_SENT_TOTAL = "pdserve_prefill_kv_chunks_sent_total"
PREFILL_KV_TRANSFER_FAILURES_TOTAL = "pdserve_prefill_kv_transfer_failures_total"
PREFILL_RUNNING_REQUESTS = "pdserve_prefill_running_requests"
PREFILL_WAITING_REQUESTS = "pdserve_prefill_waiting_requests"
PREFILL_CPU_THREADS = "pdserve_prefill_cpu_threads"
PREFILL_ENGINE_INFO = "pdserve_prefill_engine_info"
PREFILL_REQUESTS_ABORTED_TOTAL = "pdserve_prefill_requests_aborted_total"
PREFILL_KVSTORE_ERRORS_TOTAL = "pdserve_prefill_kvstore_errors_total"
PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL = "pdserve_prefill_kv_transport_fallbacks_total"
PREFILL_KV_RANK_PAGES_TOTAL = "pdserve_prefill_kv_rank_pages_total"
PREFILL_HANDOFF_PHASE_SECONDS = "pdserve_prefill_handoff_phase_seconds"
PREFILL_ENGINE_STEP_SECONDS = "pdserve_prefill_engine_step_seconds"
PREFILL_ENGINE_STEP_TOKENS = "pdserve_prefill_engine_step_tokens"
PREFILL_ENGINE_STEP_SEQUENCES = "pdserve_prefill_engine_step_sequences"
PREFILL_ENGINE_STEPS_TOTAL = "pdserve_prefill_engine_steps_total"
PREFILL_ENGINE_BUSY_SECONDS_TOTAL = "pdserve_prefill_engine_busy_seconds_total"
PREFILL_ENGINE_BUSY_RATIO = "pdserve_prefill_engine_busy_ratio"

# --- decode -------------------------------------------------------------------------------------
DECODE_KV_WAIT_SECONDS = "pdserve_decode_kv_wait_seconds"
DECODE_KV_TRANSFER_EXPOSED_SECONDS = "pdserve_decode_kv_transfer_exposed_seconds"
DECODE_QUEUE_SECONDS = "pdserve_decode_queue_seconds"
DECODE_HANDOFF_PHASE_SECONDS = "pdserve_decode_handoff_phase_seconds"
DECODE_TPOT_SECONDS = "pdserve_decode_time_per_output_token_seconds"
DECODE_KV_RECEIVED_BYTES_TOTAL = "pdserve_decode_kv_received_bytes_total"
DECODE_KV_CHUNKS_RECEIVED_TOTAL = "pdserve_decode_kv_chunks_received_total"
DECODE_KV_CHUNKS_REJECTED_TOTAL = "pdserve_decode_kv_chunks_rejected_total"
DECODE_RESERVATIONS_EXPIRED_TOTAL = "pdserve_decode_reservations_expired_total"
DECODE_KV_CACHE_USAGE_RATIO = "pdserve_decode_kv_cache_usage_ratio"
DECODE_RUNNING_REQUESTS = "pdserve_decode_running_requests"
DECODE_WAITING_REQUESTS = "pdserve_decode_waiting_requests"
DECODE_CPU_THREADS = "pdserve_decode_cpu_threads"
DECODE_COMPILED_STEP_BATCH_SIZES = "pdserve_decode_compiled_step_batch_sizes"
DECODE_STEP_COMPILE_SECONDS = "pdserve_decode_step_compile_seconds"
DECODE_WAITING_FOR_KV_REQUESTS = "pdserve_decode_waiting_for_kv_requests"
DECODE_WAITING_FOR_BLOCKS_REQUESTS = "pdserve_decode_waiting_for_blocks_requests"
DECODE_GENERATION_TOKENS_TOTAL = "pdserve_decode_generation_tokens_total"
DECODE_KV_STREAMS_BROKEN_TOTAL = "pdserve_decode_kv_streams_broken_total"
DECODE_REQUESTS_REFUSED_TOTAL = "pdserve_decode_requests_refused_total"
DECODE_ENGINE_INFO = "pdserve_decode_engine_info"
DECODE_SPEC_DRAFT_TOKENS_TOTAL = "pdserve_decode_spec_draft_tokens_total"
DECODE_SPEC_ACCEPTED_TOKENS_TOTAL = "pdserve_decode_spec_accepted_tokens_total"
DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS = "pdserve_decode_spec_acceptance_length_tokens"
DECODE_ENGINE_STEP_SECONDS = "pdserve_decode_engine_step_seconds"
DECODE_ENGINE_STEP_TOKENS = "pdserve_decode_engine_step_tokens"
DECODE_ENGINE_STEP_SEQUENCES = "pdserve_decode_engine_step_sequences"
DECODE_ENGINE_STEPS_TOTAL = "pdserve_decode_engine_steps_total"
DECODE_ENGINE_BUSY_SECONDS_TOTAL = "pdserve_decode_engine_busy_seconds_total"
DECODE_ENGINE_BUSY_RATIO = "pdserve_decode_engine_busy_ratio"

# --- kvstore ------------------------------------------------------------------------------------
KVSTORE_HITS_TOTAL = "pdserve_kvstore_hits_total"
KVSTORE_MISSES_TOTAL = "pdserve_kvstore_misses_total"
KVSTORE_EVICTIONS_TOTAL = "pdserve_kvstore_evictions_total"
KVSTORE_CORRUPT_TOTAL = "pdserve_kvstore_corrupt_total"
KVSTORE_STORED_BYTES = "pdserve_kvstore_stored_bytes"
KVSTORE_ENTRIES = "pdserve_kvstore_entries"
KVSTORE_GET_BYTES_TOTAL = "pdserve_kvstore_get_bytes_total"
KVSTORE_PUT_BYTES_TOTAL = "pdserve_kvstore_put_bytes_total"
KVSTORE_PUT_REFUSED_TOTAL = "pdserve_kvstore_put_refused_total"
KVSTORE_PUT_INFLIGHT_BYTES = "pdserve_kvstore_put_inflight_bytes"


ENGINE_INFO_LABELS = ("dtype", "dtype_reason", "device", "cpu_model", "cpu_threads", "weight_format",
                      "weight_format_reason")
"""Labels of the engine info gauges: EngineConfig.info_labels() gives their values."""


@dataclass(frozen=True)
class MetricSpec:
    """Type, labels and help of one metric; `name` is the exposed name (counters include `_total`)."""

    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    service: str
    help: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    """Histograms only: bucket bounds (seconds)."""


def _s(name: str, kind: MetricKind, labels: Sequence[str], service: str, help: str,
       buckets: tuple[float, ...] = LATENCY_BUCKETS) -> MetricSpec:
    return MetricSpec(name, kind, tuple(labels), service, help, buckets)


def _step_specs(service: str, step_s: str, tokens: str, sequences: str, steps: str, busy_s: str,
                busy_ratio: str) -> tuple[MetricSpec, ...]:
    """The engine step metrics every model-running service exports (decode: colocated workers too)."""
    return (
        _s(step_s, "histogram", ["model"], service, "Engine step duration: one scheduler step's model run, "
           "sampling and bookkeeping on the engine thread (seconds).", PHASE_BUCKETS),
        _s(tokens, "histogram", ["model"], service, "Tokens one engine step ran through the model (prefill "
           "chunk tokens plus one per decode row; count).", STEP_COUNT_BUCKETS),
        _s(sequences, "histogram", ["model"], service, "Sequences in one engine step (count).", STEP_COUNT_BUCKETS),
        _s(steps, "counter", ["model", "cuda_graph"], service, "Engine steps, by cuda_graph: graphed (replayed in "
           "a captured CUDA graph) | eager; graphed / all is the share of graphed steps."),
        _s(busy_s, "counter", ["model"], service, "Seconds the engine thread spent stepping; its rate is the "
           "busy ratio over any window."),
        _s(busy_ratio, "gauge", ["model"], service, "Share of wall time the engine thread spent stepping over "
           "the last second or more (0..1)."),
    )


SPECS: tuple[MetricSpec, ...] = (
    # router
    _s(ROUTER_TTFT_SECONDS, "histogram", ["model"], "router",
       "Client TTFT: request arrives at the router -> first token sent to the client (seconds)."),
    _s(ROUTER_ITL_SECONDS, "histogram", ["model"], "router",
       "Client inter-token latency: gap between consecutive streamed tokens (seconds).", TOKEN_BUCKETS),
    _s(ROUTER_E2E_SECONDS, "histogram", ["model"], "router",
       "End-to-end latency of completed requests: arrival at the router -> last token sent (seconds)."),
    _s(ROUTER_REQUESTS_TOTAL, "counter", ["model", "status", "finish_reason"], "router",
       "Client generation requests (HTTP and gRPC) by outcome: ok (finish_reason stop|length), error "
       "(refused or failed, 4xx included), cancelled (the client went away). Each request counts once."),
    _s(ROUTER_PROMPT_TOKENS_TOTAL, "counter", ["model"], "router", "Prompt tokens received (tokens in)."),
    _s(ROUTER_GENERATION_TOKENS_TOTAL, "counter", ["model"], "router",
       "Generated tokens sent to clients (tokens out)."),
    _s(ROUTER_ERRORS_TOTAL, "counter", ["model", "code"], "router",
       "Requests refused or failed towards the client, 4xx included, by lower-case gRPC status name "
       "(invalid_argument, unauthenticated, resource_exhausted, unavailable, deadline_exceeded, ...)."),
    _s(ROUTER_DISPATCH_RETRIES_TOTAL, "counter", ["role", "reason"], "router",
       "Dispatch attempts retried on another prefill/decode instance."),
    _s(ROUTER_INFLIGHT_REQUESTS, "gauge", ["model"], "router", "Client requests currently in flight."),
    _s(ROUTER_INSTANCE_HEALTHY, "gauge", ["role", "endpoint"], "router",
       "1 if the router sees the backend instance as SERVING, else 0."),
    _s(ROUTER_MIGRATIONS_TOTAL, "counter", ["outcome"], "router",
       "Streams moved to another decode after theirs died mid-generation, by outcome (ok, failed)."),
    _s(ROUTER_INSTANCE_WAITS_TOTAL, "counter", ["role", "outcome"], "router",
       "Dispatch steps that found no live instance of a role and waited for one to come back (a restart) "
       "within the request's deadline, by outcome (back: one answered SERVING and took the step; "
       "gave_up: the deadline or --restart-wait-s passed first)."),
    _s(ROUTER_HANDOFF_PHASE_SECONDS, "histogram", ["phase"], "router",
       "Time from a P/D request's arrival at the router to a point of its handoff (seconds): reserve (decode's "
       "Reserve answered), prefill_sent (Prefill call made), attached (an early Prefill's AttachReservation "
       "answered), prefill_response (PrefillResponse received), "
       "decode_first (decode's first message received), first_token (first token handed to the client).",
       PHASE_BUCKETS),
    # prefill
    _s(PREFILL_QUEUE_SECONDS, "histogram", ["model"], "prefill",
       "Prefill queue: Prefill request arrives -> its first chunk is scheduled (seconds)."),
    _s(PREFILL_COMPUTE_SECONDS, "histogram", ["model"], "prefill",
       "Prefill compute: first chunk scheduled -> last chunk computed (seconds)."),
    _s(PREFILL_CHUNKS_TOTAL, "counter", ["model"], "prefill", "Prefill chunks computed."),
    _s(PREFILL_COMPUTED_TOKENS_TOTAL, "counter", ["model"], "prefill",
       "Prompt tokens run through the model by prefill (cached prefix excluded)."),
    _s(PREFILL_CACHED_PREFIX_TOKENS_TOTAL, "counter", ["model", "source"], "prefill",
       "Prompt tokens not computed because a cached prefix held them, by source (local|kvstore); "
       "computed + cached = prompt tokens."),
    _s(PREFILL_KV_SKIPPED_TOKENS_TOTAL, "counter", ["model"], "prefill",
       "Prompt tokens whose KV was not sent because decode already held those blocks (computed or "
       "loaded here all the same)."),
    _s(PREFILL_KV_SENT_BYTES_TOTAL, "counter", ["transport"], "prefill",
       "KV page bytes sent to decode, by transport."),
    _s(PREFILL_KV_CHUNKS_SENT_TOTAL, "counter", ["transport"], "prefill",
       "KV chunks handed to the transport, by transport."),
    _s(PREFILL_KV_TRANSFER_FAILURES_TOTAL, "counter", ["transport", "reason"], "prefill",
       "KV transfers to decode that failed, by transport and reason."),
    _s(PREFILL_RUNNING_REQUESTS, "gauge", ["model"], "prefill", "Requests with a chunk in the running batch."),
    _s(PREFILL_WAITING_REQUESTS, "gauge", ["model"], "prefill", "Requests queued, no chunk scheduled yet."),
    _s(PREFILL_CPU_THREADS, "gauge", ["model"], "prefill",
       "torch intra-op threads the engine runs with now: its share plus the cores idle peers lend."),
    _s(PREFILL_ENGINE_INFO, "gauge", ENGINE_INFO_LABELS, "prefill",
       "1, labelled with the engine's resolved dtype and why, device, CPU model and torch threads."),
    _s(PREFILL_REQUESTS_ABORTED_TOTAL, "counter", ["reason"], "prefill",
       "Prefill requests that ended without a first token, by reason (overloaded, invalid, deadline, "
       "cancelled, kv_handoff, attach_timeout, permission, internal)."),
    _s(PREFILL_KVSTORE_ERRORS_TOTAL, "counter", ["reason"], "prefill",
       "kvstore calls that failed or were skipped (the request went on without reuse), by reason "
       "(lookup, get, put, bad_page, down, write_back_dropped, writer)."),
    _s(PREFILL_KV_TRANSPORT_FALLBACKS_TOTAL, "counter", ["transport", "reason"], "prefill",
       "Requests whose side transport (shm, cuda-ipc, mooncake) was refused or not offered, so pages went "
       "as bytes in the stream."),
    _s(PREFILL_KV_RANK_PAGES_TOTAL, "counter", ["rank"], "prefill",
       "Page slices a rank of this instance wrote straight into a decode rank's pool over a side transport "
       "(rank to rank, tensor parallelism; a page split over k decode ranks counts k)."),
    _s(PREFILL_HANDOFF_PHASE_SECONDS, "histogram", ["phase"], "prefill",
       "One phase of a P/D request at prefill (seconds): rpc_in (router sent -> Prefill arrived, Unix clocks), "
       "claim (arrival -> decode acknowledged the claim), admitted (arrival -> in the engine), attached (arrival -> "
       "an early Prefill took its AttachReservation), picked (last chunk "
       "computed -> the sender task took it), last_sent (-> its last KV message handed to the sender), finish (-> decode's PushKV answer), "
       "respond (arrival -> PrefillResponse returned).", PHASE_BUCKETS),
    *_step_specs("prefill", PREFILL_ENGINE_STEP_SECONDS, PREFILL_ENGINE_STEP_TOKENS, PREFILL_ENGINE_STEP_SEQUENCES,
                 PREFILL_ENGINE_STEPS_TOTAL, PREFILL_ENGINE_BUSY_SECONDS_TOTAL, PREFILL_ENGINE_BUSY_RATIO),
    # decode
    *_step_specs("decode", DECODE_ENGINE_STEP_SECONDS, DECODE_ENGINE_STEP_TOKENS, DECODE_ENGINE_STEP_SEQUENCES,
                 DECODE_ENGINE_STEPS_TOTAL, DECODE_ENGINE_BUSY_SECONDS_TOTAL, DECODE_ENGINE_BUSY_RATIO),
    _s(DECODE_KV_WAIT_SECONDS, "histogram", ["model"], "decode",
       "Decode KV-wait: reservation -> last KV chunk landed (seconds). Includes prefill queue and "
       "compute under parallel dispatch: NOT the transfer time."),
    _s(DECODE_KV_TRANSFER_EXPOSED_SECONDS, "histogram", ["model"], "decode",
       "Exposed KV transfer: prefill's last chunk computed -> last KV chunk landed on decode (seconds); "
       "the transfer time that chunk overlap did not hide."),
    _s(DECODE_QUEUE_SECONDS, "histogram", ["model"], "decode",
       "Decode queue: KV complete -> first decode step of the request (seconds)."),
    _s(DECODE_HANDOFF_PHASE_SECONDS, "histogram", ["phase"], "decode",
       "One phase of a P/D handoff at decode (seconds): import (last KV chunk in -> the engine thread took the "
       "request into its batch), first_message (-> its first message handed to the router's stream).", PHASE_BUCKETS),
    _s(DECODE_TPOT_SECONDS, "histogram", ["model"], "decode",
       "Time per output token after the first, measured at decode (seconds).", TOKEN_BUCKETS),
    _s(DECODE_KV_RECEIVED_BYTES_TOTAL, "counter", ["transport"], "decode",
       "KV page bytes received from prefill, by transport."),
    _s(DECODE_KV_CHUNKS_RECEIVED_TOTAL, "counter", ["transport"], "decode",
       "KV chunks accepted into the paged cache, by transport."),
    _s(DECODE_KV_CHUNKS_REJECTED_TOTAL, "counter", ["reason"], "decode",
       "KV chunks refused, by reason (fingerprint, order, range, size, checksum, incomplete, unknown_reservation)."),
    _s(DECODE_RESERVATIONS_EXPIRED_TOTAL, "counter", ["model"], "decode",
       "Block reservations released because their KV did not arrive in time."),
    _s(DECODE_KV_CACHE_USAGE_RATIO, "gauge", ["model"], "decode",
       "Fraction of KV cache blocks in use or reserved, 0..1."),
    _s(DECODE_RUNNING_REQUESTS, "gauge", ["model"], "decode", "Requests in the running decode batch."),
    _s(DECODE_CPU_THREADS, "gauge", ["model"], "decode",
       "torch intra-op threads the engine runs with now: its share plus the cores idle peers lend."),
    _s(DECODE_COMPILED_STEP_BATCH_SIZES, "gauge", ["model"], "decode",
       "CPU decode batch sizes whose step runs compiled now (--cpu-compile-decode; 0 while the background "
       "compile runs, when it is off, failed, or no size measured faster)."),
    _s(DECODE_STEP_COMPILE_SECONDS, "gauge", ["model"], "decode",
       "Seconds the background compile of the CPU decode step has spent compiling so far (0: off)."),
    _s(DECODE_WAITING_REQUESTS, "gauge", ["model"], "decode",
       "Requests with complete KV waiting to join the running batch."),
    _s(DECODE_WAITING_FOR_KV_REQUESTS, "gauge", ["model"], "decode",
       "Reserved requests whose KV has not fully landed yet."),
    _s(DECODE_WAITING_FOR_BLOCKS_REQUESTS, "gauge", ["model"], "decode",
       "Reserves queued for free KV blocks (in arrival order, holding none; counted as pending)."),
    _s(DECODE_GENERATION_TOKENS_TOTAL, "counter", ["model"], "decode", "Tokens generated by decode steps."),
    _s(DECODE_KV_STREAMS_BROKEN_TOTAL, "counter", ["model"], "decode",
       "PushKV streams that broke before their last chunk (peer gone); the reservation was kept for a retry."),
    _s(DECODE_REQUESTS_REFUSED_TOTAL, "counter", ["reason"], "decode",
       "Reserve/Generate/PushKV/RenewLease calls refused before any work, by reason "
       "(overloaded, draining, deadline, permission, caller_share)."),
    _s(DECODE_ENGINE_INFO, "gauge", ENGINE_INFO_LABELS, "decode",
       "1, labelled with the engine's resolved dtype and why, device, CPU model and torch threads."),
    _s(DECODE_SPEC_DRAFT_TOKENS_TOTAL, "counter", ["model", "acceptance"], "decode",
       "Speculative decoding: draft tokens proposed, by acceptance (real | synthetic: --spec-synthetic-acceptance)."),
    _s(DECODE_SPEC_ACCEPTED_TOKENS_TOTAL, "counter", ["model", "acceptance"], "decode",
       "Speculative decoding: draft tokens accepted and emitted, by acceptance (real | synthetic)."),
    _s(DECODE_SPEC_ACCEPTANCE_LENGTH_TOKENS, "histogram", ["model", "acceptance"], "decode",
       "Speculative decoding: tokens one verify step emitted for a request (accepted drafts + 1), by acceptance "
       "(real | synthetic).", SPEC_LENGTH_BUCKETS),
    # kvstore
    _s(KVSTORE_HITS_TOTAL, "counter", ["tier"], "kvstore", "Page lookups answered by this tier."),
    _s(KVSTORE_MISSES_TOTAL, "counter", ["tier"], "kvstore", "Page lookups this tier could not answer."),
    _s(KVSTORE_EVICTIONS_TOTAL, "counter", ["tier"], "kvstore", "Pages evicted from this tier."),
    _s(KVSTORE_CORRUPT_TOTAL, "counter", ["tier"], "kvstore",
       "Pages dropped because their checksum or layout fingerprint did not verify."),
    _s(KVSTORE_STORED_BYTES, "gauge", ["tier"], "kvstore", "Bytes of KV pages held by this tier."),
    _s(KVSTORE_ENTRIES, "gauge", ["tier"], "kvstore", "KV pages held by this tier."),
    _s(KVSTORE_GET_BYTES_TOTAL, "counter", [], "kvstore", "Page bytes returned by Get."),
    _s(KVSTORE_PUT_BYTES_TOTAL, "counter", [], "kvstore", "Page bytes accepted by Put."),
    _s(KVSTORE_PUT_REFUSED_TOTAL, "counter", ["reason"], "kvstore",
       "Put streams refused, by reason (too_large, quota, permission, invalid, checksum, idle)."),
    _s(KVSTORE_PUT_INFLIGHT_BYTES, "gauge", [], "kvstore",
       "Bytes announced by pages of open Put streams, held against --max-inflight-put-bytes."),
)

SPECS_BY_NAME: dict[str, MetricSpec] = {s.name: s for s in SPECS}
ALL_METRIC_NAMES: frozenset[str] = frozenset(SPECS_BY_NAME)
SERVICES: tuple[str, ...] = ("router", "prefill", "decode", "kvstore")

_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def series_names(name: str) -> tuple[str, ...]:
    """The sample names a metric exposes to PromQL (histograms: `_bucket`, `_sum`, `_count`)."""
    spec = SPECS_BY_NAME[name]
    if spec.kind == "histogram":
        return tuple(name + s for s in _HISTOGRAM_SUFFIXES)
    return (name,)


def metric_of_series(series: str) -> str | None:
    """Inverse of `series_names`: the metric a PromQL sample name belongs to, or None if unknown."""
    if series in SPECS_BY_NAME:
        return series
    for suffix in _HISTOGRAM_SUFFIXES:
        if series.endswith(suffix):
            spec = SPECS_BY_NAME.get(series.removesuffix(suffix))
            if spec is not None and spec.kind == "histogram":
                return spec.name
    return None


ATTRIBUTES: dict[str, str] = {
    value: const.split("_", 1)[1].lower() for const, value in dict(globals()).items()
    if const.isupper() and isinstance(value, str) and value in SPECS_BY_NAME
}
"""Exposed name -> attribute of its service's group: the NAME constant without its service prefix, lower
case (ROUTER_TTFT_SECONDS -> RouterMetrics.ttft_seconds)."""

_KINDS: dict[MetricKind, type[MetricWrapperBase]] = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class MetricGroup:
    """Builds one service's metrics (every `SPECS` entry of ``SERVICE``) into a registry, each as the
    attribute ``ATTRIBUTES`` names, and remembers them by exposed name."""

    SERVICE = ""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._by_name: dict[str, MetricWrapperBase] = {}
        for spec in SPECS:
            if spec.service == self.SERVICE:
                extra = {"buckets": spec.buckets} if spec.kind == "histogram" else {}
                metric = _KINDS[spec.kind](spec.name, spec.help, spec.labels, registry=registry, **extra)
                self._by_name[spec.name] = metric
                setattr(self, ATTRIBUTES[spec.name], metric)

    def by_name(self) -> dict[str, MetricWrapperBase]:
        """Exposed metric name (a `SPECS` name) -> prometheus_client object."""
        return dict(self._by_name)


class RouterMetrics(MetricGroup):
    """Client-facing timers and counters of the router."""

    SERVICE = "router"


class PrefillMetrics(MetricGroup):
    """Prefill scheduling, compute, prefix reuse and outgoing KV."""

    SERVICE = "prefill"


class DecodeMetrics(MetricGroup):
    """Decode KV arrival, queueing, token pace and cache pressure."""

    SERVICE = "decode"


class KVStoreMetrics(MetricGroup):
    """Per-tier hit/miss/eviction accounting and occupancy of the kvstore."""

    SERVICE = "kvstore"


METRICS_CLASSES: dict[str, type[MetricGroup]] = {
    "router": RouterMetrics,
    "prefill": PrefillMetrics,
    "decode": DecodeMetrics,
    "kvstore": KVStoreMetrics,
}


class MetricsServer:
    """A running /metrics HTTP server (prometheus_client's WSGI server in a daemon thread)."""

    def __init__(self, registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> None:
        result = start_http_server(port, addr=host, registry=registry)
        if result is None:  # prometheus_client < 0.20 returns nothing; port 0 would be unknowable
            raise RuntimeError("prometheus_client >= 0.20 is required (start_http_server must return the server)")
        self._httpd, self._thread = result
        self.host = host
        self.port: int = int(self._httpd.server_address[1])

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


_servers: dict[int, MetricsServer] = {}
_servers_lock = threading.Lock()


def start_metrics_server(registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 0) -> int:
    """Serve `registry` on http://host:port/metrics in a daemon thread; returns the bound port (port 0 works)."""
    server = MetricsServer(registry, host, port)
    with _servers_lock:
        _servers[server.port] = server
    return server.port


def stop_metrics_server(port: int) -> None:
    """Stop a server started by `start_metrics_server`; unknown ports are ignored."""
    with _servers_lock:
        server = _servers.pop(port, None)
    if server is not None:
        server.stop()


def render_metrics(registry: CollectorRegistry) -> tuple[bytes, str]:
    """Exposition body and content type, for services that mount /metrics on their own HTTP server."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
