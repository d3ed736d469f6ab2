"""services/common/tracing.py: W3C context crosses gRPC metadata; off costs nothing and needs no otel."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common import tracing

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def memory_tracing() -> Iterator[None]:
    pytest.importorskip("opentelemetry.sdk")
    assert tracing.setup_tracing("test", exporter="memory")
    yield
    tracing.shutdown_tracing()


class _Metadatum:
    """Shape of grpc.aio's invocation_metadata() items."""

    def __init__(self, key: str, value: str) -> None:
        self.key, self.value = key, value


def test_parent_links_across_metadata(memory_tracing: None) -> None:
    # "router" starts a span and calls out; "prefill" extracts the caller's context from metadata.
    with tracing.span("router.dispatch", request_id="r1", prompt_tokens=12, skipped=None) as client_span:
        metadata = tracing.inject_metadata([("x-request-id", "r1")])
        client_ctx = client_span.get_span_context()
    assert metadata[0] == ("x-request-id", "r1")
    keys = [k for k, _ in metadata]
    assert "traceparent" in keys

    server_md = [_Metadatum(k, v) for k, v in metadata]
    assert tracing.extract_context(server_md) is not None
    with tracing.span_from_metadata("prefill.Prefill", server_md, request_id="r1"):
        with tracing.span("prefill.chunk", chunk=0):
            pass

    spans = {s.name: s for s in tracing.finished_spans()}
    assert set(spans) == {"router.dispatch", "prefill.Prefill", "prefill.chunk"}
    server, chunk = spans["prefill.Prefill"], spans["prefill.chunk"]
    assert server.context.trace_id == client_ctx.trace_id
    assert server.parent is not None and server.parent.span_id == client_ctx.span_id
    assert server.parent.is_remote
    assert chunk.parent is not None and chunk.parent.span_id == server.context.span_id
    assert spans["router.dispatch"].attributes == {"request_id": "r1", "prompt_tokens": 12}
    assert tracing.memory_exporter() is not None


def test_server_span_without_metadata_is_root(memory_tracing: None) -> None:
    assert tracing.extract_context(None) is None
    assert tracing.extract_context([("x-other", "1")]) is None
    with tracing.span_from_metadata("decode.Reserve", [("x-other", "1")]):
        pass
    (s,) = tracing.finished_spans()
    assert s.parent is None


def test_exception_is_recorded(memory_tracing: None) -> None:
    with pytest.raises(ValueError), tracing.span("kvstore.Get"):
        raise ValueError("boom")
    (s,) = tracing.finished_spans()
    assert not s.status.is_ok
    assert any(e.name == "exception" for e in s.events)


def test_off_is_noop() -> None:
    tracing.setup_tracing("test", exporter="none")
    assert not tracing.tracing_enabled()
    with tracing.span("x", a=1) as s:
        s.set_attribute("k", "v")
        assert not s.is_recording()
    assert tracing.inject_metadata([("a", "b")]) == [("a", "b")]
    assert tracing.extract_context([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is None
    with tracing.span_from_metadata("y", None) as s2:
        assert s2 is tracing.NOOP_SPAN
    assert tracing.finished_spans() == []


def test_bad_exporter_rejected() -> None:
    with pytest.raises(ValueError, match="otlp"):
        tracing.setup_tracing("test", exporter="jaeger")


_BLOCK_OTEL = textwrap.dedent("""
    import sys
    class _Block:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError(f"blocked for the test: {name}")
            return None
    sys.meta_path.insert(0, _Block())
""")


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_OTEL + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_runs_without_opentelemetry_installed() -> None:
    proc = _run("""
        from services.common import tracing
        assert tracing.setup_tracing("router", exporter="none") is False
        with tracing.span("a", x=1) as s:
            s.set_attribute("k", 1)
        assert tracing.inject_metadata() == []
        with tracing.span_from_metadata("b", [("traceparent", "junk")]):
            pass
        assert not any(m.startswith("opentelemetry") for m in sys.modules), "opentelemetry was imported"
        try:
            tracing.setup_tracing("router", exporter="console")
        except tracing.TracingUnavailableError as e:
            print("ERR", e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "pdserve[otlp]" in proc.stdout


def test_off_does_not_import_opentelemetry() -> None:
    proc = subprocess.run(
        [sys.executable, "-c",
         "import sys\nfrom services.common import tracing\n"
         "with tracing.span('a'):\n    tracing.inject_metadata()\n"
         "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_otlp_missing_names_the_extra() -> None:
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the OTLP exporter is installed here")
    with pytest.raises(tracing.TracingUnavailableError, match=r"pdserve\[otlp\]"):
        tracing.setup_tracing("router", exporter="otlp", endpoint="http://127.0.0.1:4317")
    assert not tracing.tracing_enabled()
