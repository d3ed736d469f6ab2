"""The Admin service (common.proto) every pdserve service serves: a load report and a timed trace
capture. Torch-free: the router and the kvstore serve it with :class:`PythonTraceCapture`; engine
processes plug in the torch profiler (services/worker/admin.py).

A capture writes a Chrome trace (chrome://tracing, Perfetto) under the service's own trace root; a
request names only a session sub-directory (a plain name, never a path), so no caller can make the
service write anywhere else.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable

import grpc

from services.common.grpc_util import Reason, abort, error_detail
from services.common.pb import common_pb2, common_pb2_grpc

LoadFn = Callable[[], Awaitable[dict[str, float]]]
DEFAULT_TRACE_ROOT = os.path.join(tempfile.gettempdir(), "pdserve-traces")
_SESSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class IncompleteTraceError(RuntimeError):
    """This process wrote its trace but another rank of its instance did not (the message names it)."""


class TraceCapture:
    """A profiler run over a wall-clock window, written as a Chrome trace under ``root/<session>/``.

    ``start_unix`` lets many services capture the same window; :meth:`_record` runs on a worker thread
    and is what a subclass supplies (the profiler)."""

    def __init__(self, service: str, instance: str, root: str = "") -> None:
        self.service = service
        self.instance = instance
        self.root = os.path.abspath(root or DEFAULT_TRACE_ROOT)
        self._lock = asyncio.Lock()
        self.rank_paths: dict[str, list[str]] = {}
        """Rank 0's trace path -> the traces of ranks 1..N-1 captured with it (tensor-parallel instances)."""

    @staticmethod
    def session_problem(session: str) -> str | None:
        """Why ``session`` is not an acceptable session name, or None."""
        if _SESSION_RE.match(session) is None or ".." in session:
            return (f"must be a plain name of 1-64 letters, digits, '.', '_' or '-' (no path), "
                    f"got {session[:80]!r}")
        return None

    def _record(self, duration_s: float, path: str) -> None:
        """Worker thread: profile this process for ``duration_s`` seconds, write the trace to ``path``."""
        raise NotImplementedError

    def _capture(self, start_unix: float, duration_s: float, session: str) -> str:
        delay = start_unix - time.time()
        if delay > 0:
            time.sleep(delay)
        out_dir = os.path.join(self.root, session)
        os.makedirs(out_dir, mode=0o700, exist_ok=True)
        safe = self.instance.replace(":", "_").replace("/", "_")
        path = os.path.join(out_dir, f"{self.service}-{safe}-{int(time.time() * 1000)}.trace.json")
        self._record(duration_s, path)
        return path

    async def capture(self, start_unix: float, duration_s: float, session: str) -> str:
        async with self._lock:  # one profiler session per process
            return await asyncio.to_thread(self._capture, start_unix, duration_s, session)


class PythonTraceCapture(TraceCapture):
    """Samples every thread's Python stack each ``interval_s`` and writes the runs of identical frames
    as Chrome trace begin/end events (one track per thread): where a process without torch (router,
    kvstore) spends its time, e.g. the event loop's tokenization or JSON work. At most ``max_events``
    events; sampling stops there."""

    def __init__(self, service: str, instance: str, root: str = "", *, interval_s: float = 0.001,
                 max_depth: int = 48, max_events: int = 1_000_000) -> None:
        super().__init__(service, instance, root)
        self.interval_s = interval_s
        self.max_depth = max_depth
        self.max_events = max_events

    def _stacks(self, me: int) -> dict[int, list[str]]:
        """Thread id -> frames outermost first ("function (file:line)"), this sampler's thread excluded."""
        out: dict[int, list[str]] = {}
        for tid, frame in sys._current_frames().items():
            if tid == me:
                continue
            names: list[str] = []
            f = frame
            while f is not None:
                code = f.f_code
                names.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{code.co_firstlineno})")
                f = f.f_back
            out[tid] = names[::-1][: self.max_depth]
        return out

    def _record(self, duration_s: float, path: str) -> None:
        pid, me = os.getpid(), threading.get_ident()
        t0 = time.perf_counter()
        events: list[dict[str, object]] = []
        open_stacks: dict[int, list[str]] = {}

        def ts() -> float:
            return (time.perf_counter() - t0) * 1e6  # microseconds

        while time.perf_counter() - t0 < duration_s and len(events) < self.max_events:
            now = ts()
            for tid, stack in self._stacks(me).items():
                prev = open_stacks.get(tid, [])
                common = 0
                while common < min(len(prev), len(stack)) and prev[common] == stack[common]:
                    common += 1
                events += [{"ph": "E", "pid": pid, "tid": tid, "ts": now} for _ in prev[common:]]
                events += [{"ph": "B", "pid": pid, "tid": tid, "ts": now, "name": name} for name in stack[common:]]
                open_stacks[tid] = stack
            time.sleep(self.interval_s)
        end = ts()
        for tid, stack in open_stacks.items():
            events += [{"ph": "E", "pid": pid, "tid": tid, "ts": end} for _ in stack]
        names = {t.ident: t.name for t in threading.enumerate()}
        events += [{"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                    "args": {"name": names.get(tid, str(tid))}} for tid in open_stacks]
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"service": self.service, "instance": self.instance,
                                     "sampler_interval_s": self.interval_s}}, f)


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
        except IncompleteTraceError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        return common_pb2.CaptureTraceResponse(path=path, service=self._trace.service, instance=self._trace.instance,
                                               rank_paths=self._trace.rank_paths.pop(path, []))
