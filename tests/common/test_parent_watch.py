"""A service started with --parent-pid stops when its launcher dies, even by SIGKILL (it runs in its own
session, so no signal reaches it otherwise); without the flag it keeps running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process_util import alive

# A stand-in launcher: starts a kvstore (torch-free, quick) in its own session, reports the pid once the
# kvstore is ready, then waits to be killed.
_LAUNCHER = r"""
import os, subprocess, sys, time
watch = sys.argv[1] == "watch"
cmd = [sys.executable, "-m", "services.kvstore", "--port", "0", "--metrics-port", "-1", "--backend", "embedded"]
if watch:
    cmd += ["--parent-pid", str(os.getpid())]
child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
for line in child.stdout:
    if line.startswith("PDSERVE_READY"):
        print(child.pid, flush=True)
        break
time.sleep(600)
"""


def _start(mode: str) -> tuple[subprocess.Popen[str], int]:
    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, mode], stdout=subprocess.PIPE, text=True,
                                cwd=root)
    assert launcher.stdout is not None
    line = launcher.stdout.readline()
    assert line.strip().isdigit(), f"launcher did not report a ready kvstore: {line!r}"
    return launcher, int(line)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(180)
def test_service_stops_when_its_launcher_is_killed() -> None:
    launcher, pid = _start("watch")
    try:
        assert alive(pid)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert _wait_gone(pid, 60), "the kvstore outlived its SIGKILLed launcher despite --parent-pid"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_without_parent_pid_the_service_keeps_running() -> None:
    launcher, pid = _start("nowatch")
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        assert not _wait_gone(pid, 3), "the kvstore stopped although no --parent-pid was given"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)
