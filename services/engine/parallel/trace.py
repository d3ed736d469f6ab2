"""Trace capture on every rank: rank 0 announces a window and a file stem (plan.py TRACE), each rank
profiles itself over the same wall-clock window and writes ``<stem>-rank<r>.trace.json``; rank 0 waits
for every file and names the ranks whose trace is missing.

Files appear atomically (written to a temporary name, then renamed), so a file that exists is complete.
"""

from __future__ import annotations

import os
import threading
import time

import torch


def rank_trace_path(stem: str, rank: int) -> str:
    return f"{stem}-rank{rank}.trace.json"


def record(start_unix: float, duration_s: float, path: str) -> None:
    """Sleep until ``start_unix``, profile this process for ``duration_s`` s, write a Chrome trace to ``path``."""
    delay = start_unix - time.time()
    if delay > 0:
        time.sleep(delay)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        time.sleep(duration_s)
    tmp = f"{path}.part"
    prof.export_chrome_trace(tmp)
    os.replace(tmp, path)


def start_recording(start_unix: float, duration_s: float, path: str) -> threading.Thread:
    """A rank's capture off its plan loop (the loop keeps computing while it is profiled)."""
    t = threading.Thread(target=record, args=(start_unix, duration_s, path), name="pdserve-tp-trace", daemon=True)
    t.start()
    return t


def missing_traces(paths: list[str], deadline_unix: float, poll_s: float = 0.1) -> list[int]:
    """Wait until every path exists or the deadline passes; the indexes of the paths still missing."""
    while True:
        missing = [i for i, p in enumerate(paths) if not os.path.isfile(p)]
        if not missing or time.time() >= deadline_unix:
            return missing
        time.sleep(poll_s)
