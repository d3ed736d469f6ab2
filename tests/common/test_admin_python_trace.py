"""The torch-free Admin trace capture (router, kvstore): a Chrome trace of every thread's Python stacks."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from services.common.admin import PythonTraceCapture, TraceCapture


def _busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def test_capture_writes_a_balanced_chrome_trace_of_other_threads(tmp_path: Path) -> None:
    stop = threading.Event()
    worker = threading.Thread(target=_busy, args=(stop,), name="busy-worker")
    worker.start()
    try:
        cap = PythonTraceCapture("router", "127.0.0.1:1", str(tmp_path))
        path = asyncio.run(cap.capture(time.time(), 0.3, "s1"))
    finally:
        stop.set()
        worker.join()
    assert Path(path).parent == tmp_path / "s1"
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"]
    opened = Counter(e["tid"] for e in events if e["ph"] == "B")
    closed = Counter(e["tid"] for e in events if e["ph"] == "E")
    assert opened == closed and opened  # every frame run that begins also ends
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert "busy-worker" in names
    assert any("_busy" in e.get("name", "") for e in events if e["ph"] == "B")
    assert trace["otherData"]["service"] == "router"


@pytest.mark.parametrize("session", ["", "../x", "a/b", "x" * 65, ".."])
def test_session_names_are_never_paths(session: str) -> None:
    assert TraceCapture.session_problem(session) is not None
