"""services/engine/cpu/trace_fence.py: once a background compile was set up in a process, every CPU model step
takes the fence, even while no compile is counted running (a step that skipped it could still run when
another engine's compile opens a tracer window)."""

from __future__ import annotations

import threading

from services.engine.cpu import trace_fence


def test_steps_take_the_fence_once_installed_whatever_the_count() -> None:
    assert trace_fence.install()
    assert trace_fence._active == 0
    got: list[bool] = []

    def tracer_window() -> None:  # another thread cannot take the lock while the step holds it
        got.append(trace_fence._LOCK.acquire(blocking=False))
        if got[-1]:
            trace_fence._LOCK.release()

    with trace_fence.fence():
        t = threading.Thread(target=tracer_window)
        t.start()
        t.join()
    assert got == [False]
