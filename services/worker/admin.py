"""The Admin service of the engine-backed services (prefill, decode): services/common/admin.py's servicer
with the torch profiler as its trace capture."""

from __future__ import annotations

import time

from services.common.admin import DEFAULT_TRACE_ROOT, AdminServicer, LoadFn
from services.common.admin import TraceCapture as _Capture

__all__ = ["DEFAULT_TRACE_ROOT", "AdminServicer", "LoadFn", "TraceCapture"]


class TraceCapture(_Capture):
    """torch.profiler over the window (CPU, and CUDA when present). Profiling is process-wide, so the
    engine thread's work is recorded although the profiler runs on a worker thread."""

    def _record(self, duration_s: float, path: str) -> None:
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                *([torch.profiler.ProfilerActivity.CUDA]
                                                  if torch.cuda.is_available() else [])]) as prof:
            time.sleep(duration_s)
        prof.export_chrome_trace(path)
