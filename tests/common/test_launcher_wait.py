"""LocalCluster._wait: a ready line that lands just after one bounded wait timed out is a ready service, not a
failed start; a service that exited without one is a failed start named with its exit code."""

from __future__ import annotations

import threading

import pytest

from services.launcher import LocalCluster


class _Popen:
    def __init__(self, code: int | None) -> None:
        self.code = code

    def poll(self) -> int | None:
        return self.code


class _Proc:
    """What _wait reads of a launch; ``ready_late``: the ready line arrives while the first wait is timing out."""

    def __init__(self, ready_late: bool) -> None:
        self.name, self.event, self.ready, self.waits = "router", threading.Event(), {}, 0
        self.ready_late = ready_late
        self.popen = _Popen(None if ready_late else 3)

    def wait_ready(self, timeout: float) -> bool:
        self.waits += 1
        if self.waits == 1:  # the bounded wait times out; the line (or the exit) lands right after it
            if self.ready_late:
                self.ready = {"grpc": "127.0.0.1:1"}
            self.event.set()
            return False
        return self.event.wait(timeout) and bool(self.ready)

    def tail(self, n: int) -> str:
        return "last lines"


def test_a_ready_line_just_after_a_timed_out_wait_is_ready() -> None:
    p = _Proc(ready_late=True)
    LocalCluster()._wait([p], 5.0)
    assert p.waits == 2


def test_an_exit_without_a_ready_line_fails_the_start() -> None:
    with pytest.raises(RuntimeError, match=r"router did not become ready \(exit code 3\)"):
        LocalCluster()._wait([_Proc(ready_late=False)], 5.0)
