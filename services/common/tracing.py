"""Optional OpenTelemetry tracing across router -> prefill/decode -> kvstore.

Off by default and free when off: this module imports nothing from opentelemetry until
`setup_tracing` is called with an exporter other than "none", so services run where opentelemetry
is not installed, and `span()` / `inject_metadata()` are no-ops costing one global read.

    setup_tracing("router", exporter="otlp", endpoint="http://otel-collector:4317")
    with span("router.dispatch", request_id=rid):
        stub.Prefill(req, metadata=inject_metadata())        # W3C traceparent in gRPC metadata

    # server side (prefill servicer)
    with span_from_metadata("prefill.Prefill", context.invocation_metadata(), request_id=rid):
        ...

Exporters: "none" (off), "console" (stdout), "memory" (kept in process; tests read
`finished_spans()`), "otlp" (gRPC OTLP to `endpoint`; needs `pip install 'pdserve[otlp]'`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from services.common.config import opt

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

Exporter = Literal["none", "otlp", "console", "memory"]
EXPORTERS: tuple[str, ...] = ("none", "otlp", "console", "memory")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
OTLP_EXTRA_HINT = "pip install 'pdserve[otlp]'"


class _NoopSpan:
    """Stands in for an OpenTelemetry span when tracing is off."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def record_exception(self, exception: BaseException) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def end(self) -> None:
        pass


NOOP_SPAN = _NoopSpan()


class _State:
    """Process-wide tracing state; `tracer is None` means off."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tracer: Tracer | None = None
        self.provider: TracerProvider | None = None
        self.memory: InMemorySpanExporter | None = None
        self.propagator: Any = None
        self.service_name: str = ""


_state = _State()


class TracingUnavailableError(RuntimeError):
    """Tracing was asked for but the opentelemetry packages it needs are missing."""


@dataclass
class TracingConfig:
    """OpenTelemetry export of a service's spans; the configs of the services that trace (router,
    prefill, decode) inherit these fields, so each flag and ``PDSERVE_*`` variable is declared here once."""

    tracing: str = opt("none", "OpenTelemetry exporter: none, console, otlp.", choices=("none", "console", "otlp"))
    otlp_endpoint: str = opt("", "OTLP collector endpoint when --tracing otlp.")

    def setup_tracing(self, service_name: str) -> bool:
        """:func:`setup_tracing` with these settings; returns whether tracing is on."""
        return setup_tracing(service_name, self.tracing, self.otlp_endpoint or None)


def tracing_enabled() -> bool:
    return _state.tracer is not None


def setup_tracing(
    service_name: str,
    exporter: str = "none",
    endpoint: str | None = None,
    *,
    sample_ratio: float = 1.0,
    attributes: Mapping[str, str] | None = None,
) -> bool:
    """Configure tracing for this process; returns whether tracing is on.

    Calling it again replaces the previous configuration (the old provider is flushed and shut down).
    `sample_ratio` applies to root spans; child spans follow their parent's decision.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"tracing exporter must be one of {', '.join(EXPORTERS)}; got {exporter!r}")
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"tracing sample ratio must be in [0, 1]; got {sample_ratio}")
    if exporter == "none":
        shutdown_tracing()
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        raise TracingUnavailableError(
            f"tracing exporter {exporter!r} needs opentelemetry-api and opentelemetry-sdk "
            f"({OTLP_EXTRA_HINT} installs them with the OTLP exporter): {e}") from e

    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, **(attributes or {})}),
        sampler=ParentBased(TraceIdRatioBased(sample_ratio)),
    )
    memory: InMemorySpanExporter | None = None
    if exporter == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise TracingUnavailableError(
                f"tracing exporter 'otlp' needs opentelemetry-exporter-otlp-proto-grpc: {OTLP_EXTRA_HINT}") from e
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    elif exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    else:
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))

    with _state.lock:
        old = _state.provider
        _state.provider = provider
        _state.tracer = provider.get_tracer("pdserve")
        _state.memory = memory
        _state.propagator = TraceContextTextMapPropagator()
        _state.service_name = service_name
    if old is not None:
        old.shutdown()
    log.info("tracing on: service=%s exporter=%s endpoint=%s ratio=%s", service_name, exporter, endpoint,
             sample_ratio)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter; tracing is off afterwards."""
    with _state.lock:
        provider = _state.provider
        _state.provider = None
        _state.tracer = None
        _state.memory = None
        _state.propagator = None
    if provider is not None:
        provider.shutdown()


@contextmanager
def span(name: str, parent: Context | None = None, **attrs: Any) -> Iterator[Any]:
    """A span around the block, child of the current span (or of `parent`); no-op when tracing is off.

    Exceptions escaping the block are recorded on the span and re-raised.
    """
    tracer = _state.tracer
    if tracer is None:
        yield NOOP_SPAN
        return
    with tracer.start_as_current_span(name, context=parent, attributes=_clean(attrs)) as s:
        yield s


def inject_metadata(metadata: Iterable[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """gRPC call metadata carrying the current span's W3C `traceparent` (+ `tracestate`).

    `metadata` (other entries for the same call) is kept in front. With tracing off, or no current
    span, it comes back unchanged.
    """
    out = list(metadata)
    propagator = _state.propagator
    if propagator is None:
        return out
    carrier: dict[str, str] = {}
    propagator.inject(carrier)
    out.extend((k, v) for k, v in carrier.items() if k in (TRACEPARENT, TRACESTATE))
    return out


def extract_context(invocation_metadata: Iterable[Any] | None) -> Context | None:
    """The remote parent context from a server's `context.invocation_metadata()`; None when off/absent.

    Accepts (key, value) tuples and grpc `_Metadatum` objects alike.
    """
    propagator = _state.propagator
    if propagator is None or invocation_metadata is None:
        return None
    carrier: dict[str, str] = {}
    for item in invocation_metadata:
        key, value = (item.key, item.value) if hasattr(item, "key") else (item[0], item[1])
        if key in (TRACEPARENT, TRACESTATE) and isinstance(value, str):
            carrier[key] = value
    if TRACEPARENT not in carrier:
        return None
    ctx: Context = propagator.extract(carrier)
    return ctx


@contextmanager
def span_from_metadata(name: str, metadata: Iterable[Any] | None, **attrs: Any) -> Iterator[Any]:
    """A server span whose parent is the caller's span carried in gRPC metadata (root if none)."""
    if _state.tracer is None:
        yield NOOP_SPAN
        return
    from opentelemetry.trace import SpanKind

    tracer = _state.tracer
    with tracer.start_as_current_span(name, context=extract_context(metadata), kind=SpanKind.SERVER,
                                      attributes=_clean(attrs)) as s:
        yield s


def start_server_span(name: str, metadata: Iterable[Any] | None, **attrs: Any) -> Any:
    """A server span like :func:`span_from_metadata`'s that is not made current and ends when the caller
    calls ``end()`` (for a request that starts in one task and ends in another); NOOP_SPAN when off."""
    if _state.tracer is None:
        return NOOP_SPAN
    from opentelemetry.trace import SpanKind

    return _state.tracer.start_span(name, context=extract_context(metadata), kind=SpanKind.SERVER,
                                    attributes=_clean(attrs))


def memory_exporter() -> InMemorySpanExporter | None:
    """The in-memory exporter when set up with exporter="memory", else None."""
    return _state.memory


def finished_spans() -> list[ReadableSpan]:
    """Spans ended so far under exporter="memory" (empty otherwise)."""
    memory = _state.memory
    return list(memory.get_finished_spans()) if memory is not None else []


def _clean(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """OpenTelemetry accepts str/bool/int/float (and sequences of them); drop None, stringify the rest."""
    out: dict[str, Any] = {}
    for k, v in attrs.items():
        if v is None:
            continue
        out[k] = v if isinstance(v, str | bool | int | float) else str(v)
    return out
