"""Trace capture of a TP=2 instance: every rank writes a trace of the same window; a rank that writes none
is named (the Admin answer of services/worker/admin.py)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import pytest

from services.common.admin import IncompleteTraceError
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker import admin


@pytest.fixture(scope="module")
def tp2():
    eng = LLMEngine(EngineConfig(model="random:tiny-llama", dtype="float32", num_kv_blocks=32, cpu_threads=1,
                                 tensor_parallel_size=2))
    yield eng
    eng.runner.release()


def _capture(tp2: LLMEngine, root: str, session: str) -> tuple[admin.TraceCapture, str]:
    cap = admin.TraceCapture("decode", "127.0.0.1:1", root)
    cap.ranks = tp2.ranks
    return cap, asyncio.run(cap.capture(time.time() + 0.2, 0.3, session))


def test_every_rank_writes_its_trace_of_the_window(tp2: LLMEngine, tmp_path) -> None:
    cap, path = _capture(tp2, str(tmp_path), "s1")
    (rank1,) = cap.rank_paths.pop(path)
    assert rank1.endswith("-rank1.trace.json") and os.path.dirname(rank1) == os.path.dirname(path)
    with open(rank1) as f:
        assert "traceEvents" in json.load(f)


def test_a_rank_without_a_trace_is_named(tp2: LLMEngine, tmp_path, monkeypatch) -> None:
    """Rank 1 dies inside the window (last test: the instance is dead afterwards)."""
    monkeypatch.setattr(admin, "RANK_TRACE_WAIT_S", 1.0)
    killer = threading.Timer(0.35, os.kill, (tp2.ranks.procs[0].pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(IncompleteTraceError, match=r"rank\(s\) 1 of 2 wrote no trace"):
            _capture(tp2, str(tmp_path), "s2")
    finally:
        killer.join()
