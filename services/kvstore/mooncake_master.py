"""Start and stop a real ``mooncake_master`` (Mooncake Store's metadata/allocation server) on loopback.

Used by tests, benchmarks and ``pdserve up --kvstore mooncake``. Every socket the master opens is pointed
at ``host`` (127.0.0.1 by default): the RPC server (``-rpc_address``/``-rpc_port``), the metrics/admin
HTTP server (``-metrics_host``/``-metrics_port``) and, although it stays disabled, the HTTP metadata
server (``-http_metadata_server_host``/``-http_metadata_server_port``). HA, KV events and snapshots stay
off, so nothing else listens. Clients use ``metadata_server="P2PHANDSHAKE"``: no etcd.

    python -m services.kvstore.mooncake_master --rpc-port 50051   # foreground, Ctrl-C stops it
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from services.common.cli_args import ArgParser
from services.common.logging import write_line

LOOPBACK = "127.0.0.1"


def find_master_binary() -> str | None:
    """Path of the ``mooncake_master`` executable, or None when Mooncake is not installed.

    Prefers the ELF binary inside the ``mooncake`` package (the console script of the same name only
    execs it) so the pid we hold is the master's own.
    """
    try:
        import mooncake
    except ImportError:
        mooncake = None  # type: ignore[assignment]
    if mooncake is not None and mooncake.__file__ is not None:
        candidate = Path(mooncake.__file__).parent / "mooncake_master"
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                with contextlib.suppress(OSError):
                    candidate.chmod(candidate.stat().st_mode | 0o111)
            return str(candidate)
    return shutil.which("mooncake_master")


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on right now (another process may still take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MooncakeMaster:
    """One ``mooncake_master`` child process. Ports 0 are replaced by free ports at start()."""

    def __init__(self, *, host: str = LOOPBACK, rpc_port: int = 0, metrics_port: int = 0,
                 extra_args: Sequence[str] = (), log_path: str | os.PathLike[str] | None = None,
                 binary: str | None = None) -> None:
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.binary = binary or find_master_binary()
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master RPC server (what clients pass as master_server_addr)."""
        return f"{self.host}:{self.rpc_port}"

    def command(self) -> list[str]:
        if self.binary is None:
            raise FileNotFoundError("mooncake_master not found: install mooncake-transfer-engine-non-cuda "
                                    "(pip install 'pdserve[mooncake]')")
        return [
            self.binary,
            f"-rpc_address={self.host}", f"-rpc_port={self.rpc_port}", f"-port={self.rpc_port}",
            f"-metrics_host={self.host}", f"-metrics_port={self.metrics_port}",
            "-enable_http_metadata_server=false",
            f"-http_metadata_server_host={self.host}", f"-http_metadata_server_port={free_port(self.host)}",
            "-enable_ha=false", "-enable_kv_events=false", "-enable_snapshot=false",
            "-enable_metric_reporting=false", "-logtostderr=true",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 15.0) -> MooncakeMaster:
        """Launch the master and wait until its RPC port accepts connections."""
        if self.proc is not None:
            raise RuntimeError("mooncake_master already started")
        self.rpc_port = self.rpc_port or free_port(self.host)
        self.metrics_port = self.metrics_port or free_port(self.host)
        cmd = self.command()
        self._log = open(self.log_path, "ab") if self.log_path is not None else None
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} at start "
                                   f"(command: {' '.join(cmd)}; log: {self.log_path or 'discarded'})")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.rpc_port), timeout=0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"mooncake_master did not listen on {self.address} within {timeout_s:.1f}s "
                           f"(log: {self.log_path or 'discarded'})")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._close_log()

    def kill(self) -> None:
        """SIGKILL (a crashed master, for fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> MooncakeMaster:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog="python -m services.kvstore.mooncake_master",
                  description="Run mooncake_master on loopback in the foreground.")
    p.add_argument("--host", default=LOOPBACK, help="Address every master socket binds.")
    p.add_argument("--rpc-port", type=int, default=50051, help="Master RPC port (0: a free one).")
    p.add_argument("--metrics-port", type=int, default=0, help="Master metrics HTTP port (0: a free one).")
    p.add_argument("--parent-pid", type=int, default=0,
                   help="Stop once the process with this pid is no longer our parent (the launcher died); 0: off.")
    args, extra = p.parse_known_args(argv)
    master = MooncakeMaster(host=args.host, rpc_port=args.rpc_port, metrics_port=args.metrics_port,
                            extra_args=extra)
    master.start()
    # The same ready line as pdserve's services, so `pdserve up` can start and wait for it.
    write_line(f"PDSERVE_READY service=mooncake-master rpc={master.address} "
               f"metrics={args.host}:{master.metrics_port} pid={master.proc.pid if master.proc else 0}")
    try:
        assert master.proc is not None
        while True:
            try:
                return master.proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                if args.parent_pid and os.getppid() != args.parent_pid:
                    print("mooncake-master: the launcher exited; stopping", file=sys.stderr, flush=True)
                    return 0
    except KeyboardInterrupt:
        return 0
    finally:
        master.stop()


if __name__ == "__main__":
    sys.exit(main())
