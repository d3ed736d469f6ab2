"""One service process of a local cluster: its command, output, ready line, and restart bookkeeping.

A :class:`ServiceProc` keeps its command and environment, so it can be launched again with the same
flags (and therefore the same ports) after it exits. Each launch gets a fresh process group (a new
session), so signals to it reach the service and anything it started, and a terminal's Ctrl-C reaches
only the launcher, which stops services in order.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_OUTPUT_LOCK = threading.RLock()
"""Re-entrant: ``pdserve up``'s signal handler prints too, and may run inside an emit() of the main thread."""


def emit(line: str, *, err: bool = False) -> None:
    """Print one whole line of the launcher's output. Service-output threads and the launcher share the
    terminal: one write per line under one lock, so lines never interleave mid-line."""
    stream = sys.stderr if err else sys.stdout
    with _OUTPUT_LOCK:
        stream.write(line + "\n")
        stream.flush()

READY_PREFIX = "PDSERVE_READY "
_BIND_ERRORS = ("cannot bind", "address already in use")
_LOG_POLL_S = 0.05
"""How often a service's log file is read while the launcher waits for its ready line (seconds)."""
_TAIL_BYTES = 64 << 10
"""How much of the end of a service's log file the launcher reads for its last lines (bytes)."""


def parse_ready(line: str) -> dict[str, str] | None:
    """``PDSERVE_READY service=decode grpc=127.0.0.1:40123 ...`` -> {"service": "decode", ...}."""
    if not line.startswith(READY_PREFIX):
        return None
    return dict(kv.split("=", 1) for kv in line[len(READY_PREFIX):].split() if "=" in kv)


def exit_text(code: int) -> str:
    """A returncode as people read it: "exit code 1", "signal SIGKILL"."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True)
class RestartPolicy:
    """When a supervised service that exited is started again.

    The k-th restart within ``window_s`` waits ``backoff_s * 2**k`` (capped at ``max_backoff_s``); a
    service that already restarted ``max_restarts`` times within the window is given up."""

    max_restarts: int = 5
    window_s: float = 60.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"invalid restart policy {self}")

    def recent(self, times: list[float], now: float) -> list[float]:
        """The restart times (monotonic seconds) that fall within the window ending ``now``."""
        return [t for t in times if now - t < self.window_s]

    def delay(self, recent_restarts: int) -> float:
        """Seconds to wait before the next restart, given how many happened within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2.0 ** min(recent_restarts, 30))


class ServiceProc:
    """A service process and the state a supervisor keeps about it."""

    def __init__(self, name: str, module: str, cmd: list[str], env: dict[str, str], *, echo: bool,
                 log_path: Path | None = None) -> None:
        self.name, self.module, self.cmd, self.env, self.echo = name, module, cmd, env, echo
        self.log_path = log_path
        """The service writes its output to this file itself (appended across launches): the launcher reads
        it only up to the ready line and for the last lines after an exit, so the service's log lines never
        pass through the launcher. None: the output comes through a pipe, kept and echoed (``echo``)."""
        self.popen: subprocess.Popen[str] | None = None
        # key=value pairs of the current launch's ready line (empty until it is printed).
        self.ready: dict[str, str] = {}
        self.event = threading.Event()
        self.lines: list[str] = []  # piped output: the last 400 lines, across launches
        # Supervisor state: held (being stopped/restarted on purpose), restart_due (monotonic time of a
        # scheduled restart), restart_times (monotonic times of past restarts), announce (log when ready).
        self.held = False
        self.restart_due: float | None = None
        self.restart_times: list[float] = []
        self.announce = False
        self._pumps: list[threading.Thread] = []
        self._cleaned = False  # leftovers of the current launch's group were killed

    def launch(self) -> None:
        """Start the command (again); the ready line of this launch replaces ``ready``."""
        self.ready = {}
        self._cleaned = False
        event = self.event = threading.Event()
        if self.log_path is not None:
            with open(self.log_path, "ab") as log:
                start = log.tell()
                popen = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         text=True, env=self.env, start_new_session=True)
            target, args = self._watch_file, (popen, event, start)
        else:
            popen = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, text=True, env=self.env, start_new_session=True)
            target, args = self._pump, (popen, event)
        self.popen = popen
        pump = threading.Thread(target=target, args=args, name=f"pdserve-out-{self.name}", daemon=True)
        pump.start()
        self._pumps = [t for t in self._pumps if t.is_alive()] + [pump]

    def _pump(self, popen: subprocess.Popen[str], event: threading.Event) -> None:
        assert popen.stdout is not None
        for raw in popen.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            del self.lines[:-400]
            info = parse_ready(line)
            if info is not None and popen is self.popen:
                self.ready = info
                event.set()
            elif self.echo:
                emit(f"[{self.name}] {line}")
        event.set()

    def _watch_file(self, popen: subprocess.Popen[str], event: threading.Event, start: int) -> None:
        """Read this launch's part of the log file (from byte ``start``) until its ready line or its exit, then
        stop reading: what the service logs after that never passes through the launcher."""
        assert self.log_path is not None
        with open(self.log_path, "rb") as f:
            f.seek(start)
            pending = b""
            while True:
                exited = popen.poll() is not None
                chunk = f.read()
                pending += chunk
                *whole, pending = pending.split(b"\n")
                for raw in whole:
                    info = parse_ready(raw.decode(errors="replace"))
                    if info is not None and popen is self.popen:
                        self.ready = info
                        event.set()
                        return
                if exited and not chunk:
                    break
                time.sleep(_LOG_POLL_S)
        event.set()

    def recent_lines(self, n: int) -> list[str]:
        """The last ``n`` lines the service wrote (across launches)."""
        if self.log_path is None:
            return self.lines[-n:]
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _TAIL_BYTES))
                data = f.read()
        except OSError:
            return []
        return data.decode(errors="replace").splitlines()[-n:]

    def wait_ready(self, timeout: float) -> bool:
        """Wait for this launch's ready line; False if it exited first or ``timeout`` passed."""
        return self.event.wait(timeout) and bool(self.ready)

    def tail(self, n: int) -> str:
        return "\n".join(self.recent_lines(n))

    def bind_failed(self) -> bool:
        """Whether the last output says a port could not be bound (someone else took it)."""
        return any(e in line.lower() for line in self.recent_lines(60) for e in _BIND_ERRORS)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process group of the current launch (nothing once it has been reaped:
        its pid may belong to someone else by then)."""
        if self.popen is not None and self.popen.returncode is None:
            self._killpg(sig)

    def _killpg(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)

    def kill_leftovers(self) -> None:
        """Once the service itself has exited and been reaped, SIGKILL what is left of its process group
        (children it started), once per launch. Only while no process has the service's old pid: then
        no one else can lead a group with that id, and every member is ours."""
        if self.popen is None or self.popen.returncode is None or self._cleaned:
            return
        self._cleaned = True
        if not os.path.exists(f"/proc/{self.popen.pid}"):
            self._killpg(signal.SIGKILL)

    def exited(self) -> int | None:
        """The exit code of the current launch, or None while it runs; the first time an exit is seen,
        leftovers of its group are killed."""
        if self.popen is None:
            return None
        code = self.popen.poll()
        if code is not None:
            self.kill_leftovers()
        return code

    def reap(self, timeout: float) -> int:
        """Wait up to ``timeout`` for the process to exit, SIGKILL its group after that; then kill
        whatever is left of the group (also when it had exited before). Returns the exit code."""
        assert self.popen is not None
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self._killpg(signal.SIGKILL)
            code = self.popen.wait()
        self.kill_leftovers()  # the group outlives its leader through children of the service
        return code

    def terminate(self, grace: float) -> int:
        """SIGTERM, then :meth:`reap` with ``grace``."""
        self.signal(signal.SIGTERM)
        return self.reap(grace)

    def join_output(self, timeout: float) -> None:
        for t in self._pumps:
            t.join(timeout)
