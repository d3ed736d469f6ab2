"""Which labelled series each service creates at start (at 0), so the first event after start is an
increase Prometheus sees and dashboards show 0 rather than nothing (docs/METRICS.md, "Every series
from the start")."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from services.common.metrics import (
    DECODE_KV_CHUNKS_REJECTED_TOTAL,
    DECODE_REQUESTS_REFUSED_TOTAL,
    KVSTORE_PUT_REFUSED_TOTAL,
    PREFILL_KV_TRANSFER_FAILURES_TOTAL,
    PREFILL_KVSTORE_ERRORS_TOTAL,
    PREFILL_REQUESTS_ABORTED_TOTAL,
    ROUTER_DISPATCH_RETRIES_TOTAL,
    ROUTER_REQUESTS_TOTAL,
    SPECS_BY_NAME,
    MetricGroup,
)

ROUTER_ERROR_CODES: tuple[str, ...] = (
    "invalid_argument", "not_found", "unauthenticated", "permission_denied", "already_exists",
    "resource_exhausted", "unavailable", "internal", "deadline_exceeded")
"""Values of the router's ``code`` label: lower-case gRPC status names, whichever API failed."""

KNOWN_VALUES: dict[str, tuple[str, ...]] = {
    "code": ROUTER_ERROR_CODES,
    "source": ("local", "kvstore"),
    "outcome": ("ok", "failed"),
    "transport": ("grpc", "shm", "cuda-ipc", "mooncake"),
    "cuda_graph": ("graphed", "eager"),
}
"""Closed label sets that are the same in every process; :func:`initialise` uses them."""

KNOWN_SERIES: dict[str, tuple[Mapping[str, tuple[str, ...]], ...]] = {
    ROUTER_REQUESTS_TOTAL: ({"status": ("ok",), "finish_reason": ("stop", "length")},
                            {"status": ("error",), "finish_reason": ("error",)},
                            {"status": ("cancelled",), "finish_reason": ("cancelled",)}),
    ROUTER_DISPATCH_RETRIES_TOTAL: ({"reason": ("unavailable", "overloaded", "draining", "loading",
                                                "engine_dead", "lost")},),
    PREFILL_KV_TRANSFER_FAILURES_TOTAL: ({"reason": ("unavailable", "not_found", "failed_precondition",
                                                     "data_loss", "permission_denied", "deadline_exceeded")},),
    PREFILL_REQUESTS_ABORTED_TOTAL: ({"reason": ("overloaded", "invalid", "deadline", "cancelled", "kv_handoff",
                                                 "permission", "engine_dead", "internal")},),
    PREFILL_KVSTORE_ERRORS_TOTAL: ({"reason": ("lookup", "get", "put", "bad_page", "down",
                                               "write_back_dropped", "writer")},),
    DECODE_KV_CHUNKS_REJECTED_TOTAL: ({"reason": ("fingerprint", "checksum", "unknown_reservation", "order",
                                                  "range", "size", "incomplete", "permission", "state",
                                                  "malformed", "claim")},),
    DECODE_REQUESTS_REFUSED_TOTAL: ({"reason": ("overloaded", "draining", "deadline", "permission")},),
    KVSTORE_PUT_REFUSED_TOTAL: ({"reason": ("too_large", "quota", "permission", "invalid", "checksum", "idle")},),
}
"""Per metric, groups of label values whose every combination :func:`initialise` creates (labels a
group does not name come from the context or :data:`KNOWN_VALUES`)."""


def initialise(group: MetricGroup, **context: Sequence[str]) -> int:
    """Create every series of ``group`` whose label values are known, at 0, so the first event after
    start is an increase Prometheus sees (rate()/increase() need a sample before it) and dashboards show
    0 instead of nothing. Label values come from :data:`KNOWN_SERIES`, then ``context`` (this process's
    own: ``model=("smol",)``, ``transport=("grpc", "shm")``, ``tier=("memory", "disk")``,
    ``role=("prefill", "decode")``), then :data:`KNOWN_VALUES`; a metric with a label known none of
    these ways (``endpoint``, the engine info labels) is left to appear when first set. Returns the
    number of series that exist afterwards through this call."""
    created = 0
    for name, metric in group.by_name().items():
        labels = SPECS_BY_NAME[name].labels
        if not labels:
            continue  # an unlabelled metric exists from its creation
        for known in KNOWN_SERIES.get(name, ({},)):
            values = [known.get(label) or tuple(context.get(label, ())) or KNOWN_VALUES.get(label, ())
                      for label in labels]
            if not all(values):
                continue
            for combo in itertools.product(*values):
                metric.labels(*combo)
                created += 1
    return created
