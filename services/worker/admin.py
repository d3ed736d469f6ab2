"""The Admin service of the engine-backed services (prefill, decode): services/common/admin.py's servicer
with the torch profiler as its trace capture."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable

from services.common.admin import DEFAULT_TRACE_ROOT, AdminServicer, IncompleteTraceError, LoadFn
from services.common.admin import TraceCapture as _Capture
from services.engine.parallel.launch import RankSet
from services.engine.parallel.trace import missing_traces, rank_trace_path

RANK_TRACE_WAIT_S = 60.0
"""How long rank 0 waits, after its own trace, for the other ranks' traces (seconds)."""

__all__ = ["DEFAULT_TRACE_ROOT", "AdminServicer", "LoadFn", "TraceCapture"]


class TraceCapture(_Capture):
    """torch.profiler over the window (CPU, and CUDA when present). Profiling is process-wide, so the
    engine thread's work is recorded although the profiler runs on a worker thread.

    A tensor-parallel instance (``ranks`` set once its engine runs): every rank profiles the same window;
    the capture returns once all have written their trace, or raises IncompleteTraceError naming those
    that did not."""

    ranks: RankSet | None = None
    remote: Callable[[float, str], Awaitable[str]] | None = None
    """An engine-core process's own profiler (EngineCoreClient.trace): the step loop runs there, so the
    window is recorded in that process (the front's event loop is ``remote_loop``)."""
    remote_loop: asyncio.AbstractEventLoop | None = None

    def _capture(self, start_unix: float, duration_s: float, session: str) -> str:
        ranks = self.ranks
        if ranks is None or ranks.runner is None:
            return super()._capture(start_unix, duration_s, session)
        out_dir = os.path.join(self.root, session)
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        safe = self.instance.replace(":", "_").replace("/", "_")
        stem = os.path.join(out_dir, f"{self.service}-{safe}-{int(max(start_unix, time.time()) * 1000)}")
        ranks.runner.announce_trace(start_unix, duration_s, stem)
        path = super()._capture(start_unix, duration_s, session)
        paths = [rank_trace_path(stem, r) for r in range(1, ranks.size)]
        missing = missing_traces(paths, time.time() + RANK_TRACE_WAIT_S)
        if missing:
            raise IncompleteTraceError(
                f"tensor-parallel rank(s) {', '.join(str(i + 1) for i in missing)} of {ranks.size} wrote no trace "
                f"within {RANK_TRACE_WAIT_S:g} s after the window (expected {paths[missing[0]]}; rank 0's: {path})")
        self.rank_paths[path] = paths
        return path

    def _record(self, duration_s: float, path: str) -> None:
        if self.remote is not None and self.remote_loop is not None:
            asyncio.run_coroutine_threadsafe(self.remote(duration_s, path), self.remote_loop).result()
            return
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                *([torch.profiler.ProfilerActivity.CUDA]
                                                  if torch.cuda.is_available() else [])]) as prof:
            time.sleep(duration_s)
        prof.export_chrome_trace(path)
