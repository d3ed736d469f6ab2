"""The Admin service every engine-backed service serves: load reports and timed profiler capture."""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.grpc_util import Reason, abort, error_detail
from services.common.pb import common_pb2, common_pb2_grpc

LoadFn = Callable[[], Awaitable[dict[str, float]]]
DEFAULT_TRACE_ROOT = os.path.join(tempfile.gettempdir(), "pdserve-traces")
_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TraceCapture:
    """Runs torch.profiler over a wall-clock window and writes a Chrome trace under this service's own
    trace root (``--trace-dir``); a request names only a session sub-directory (a plain name, never a
    path), so no caller can make the service write anywhere else.

    ``start_unix`` lets many services capture the same window; the profiler runs on a worker thread
    (profiling is process-wide, so the engine thread's work is recorded)."""

    def __init__(self, service: str, instance: str, root: str = "") -> None:
        self.service = service
        self.instance = instance
        self.root = os.path.abspath(root or DEFAULT_TRACE_ROOT)
        self._lock = asyncio.Lock()

    @staticmethod
    def session_problem(session: str) -> str | None:
        """Why ``session`` is not an acceptable session name, or None."""
        if _SESSION_RE.match(session) is None or ".." in session:
            return (f"must be a plain name of 1-64 letters, digits, '.', '_' or '-' (no path), "
                    f"got {session[:80]!r}")
        return None

    def _capture(self, start_unix: float, duration_s: float, session: str) -> str:
        import torch

        delay = start_unix - time.time()
        if delay > 0:
            time.sleep(delay)
        out_dir = os.path.join(self.root, session)
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        safe = self.instance.replace(":", "_").replace("/", "_")
        path = os.path.join(out_dir, f"{self.service}-{safe}-{int(time.time() * 1000)}.trace.json")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                *([torch.profiler.ProfilerActivity.CUDA]
                                                  if torch.cuda.is_available() else [])]) as prof:
            time.sleep(duration_s)
        prof.export_chrome_trace(path)
        return path

    async def capture(self, start_unix: float, duration_s: float, session: str) -> str:
        async with self._lock:  # one profiler session per process
            return await asyncio.to_thread(self._capture, start_unix, duration_s, session)


class AdminServicer(common_pb2_grpc.AdminServicer):
    def __init__(self, load: LoadFn, trace: TraceCapture, max_duration_s: float = 600.0) -> None:
        self._load = load
        self._trace = trace
        self._max = max_duration_s

    async def GetLoad(self, request: common_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
                      ) -> common_pb2.LoadReport:
        try:
            s = await self._load()
        except RuntimeError as e:  # loading, or the engine died (EngineDeadError is a RuntimeError)
            dead = "died" in str(e)
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"not ready: {e}",
                        error_detail(Reason.ERROR_REASON_ENGINE_DEAD if dead else Reason.ERROR_REASON_LOADING,
                                     retryable=True))
        return common_pb2.LoadReport(running=int(s.get("running", 0)), waiting=int(s.get("waiting", 0)),
                                     waiting_for_kv=int(s.get("waiting_for_kv", 0)),
                                     free_blocks=int(s.get("free_blocks", 0)),
                                     total_blocks=int(s.get("total_blocks", 0)),
                                     kv_usage=float(s.get("kv_usage", 0.0)),
                                     published_unix=float(s.get("published_unix", 0.0)),
                                     step_running_s=float(s.get("step_running_s", 0.0)),
                                     max_waiting=int(s.get("max_waiting", 0)),
                                     saturated=bool(s.get("saturated", 0.0)))

    async def CaptureTrace(self, request: common_pb2.CaptureTraceRequest, context: grpc.aio.ServicerContext
                           ) -> common_pb2.CaptureTraceResponse:
        if not 0 < request.duration_s <= self._max:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duration_s: must be in (0, {self._max}], got {request.duration_s}")
        problem = TraceCapture.session_problem(request.out_dir)
        if problem is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"out_dir: {problem}")
        if request.start_unix - time.time() > 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "start_unix: more than an hour ahead")
        try:
            path = await self._trace.capture(request.start_unix, request.duration_s, request.out_dir)
        except OSError as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"cannot write the trace under {self._trace.root}: {e}")
        return common_pb2.CaptureTraceResponse(path=path, service=self._trace.service, instance=self._trace.instance)
