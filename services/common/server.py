"""The fixed service lifecycle around grpc.aio.

    start()        bind gRPC (port 0: ephemeral) and metrics HTTP; health NOT_SERVING for everything
    set_serving()  after the model is loaded and warmed: health SERVING, print the PDSERVE_READY line
    shutdown()     on SIGTERM/SIGINT: health NOT_SERVING, `draining` set (servicers refuse new work),
                   await the drain hook (bounded), `await server.stop(grace)`, the shutdown hook (free
                   the device), metrics server down

The ready line (stdout, flushed, one line) is what launchers and e2e tests parse:

    PDSERVE_READY service=decode grpc=127.0.0.1:40123 metrics=127.0.0.1:40124 pid=4242

Start-up failures are one actionable line on stderr (:func:`run_main`): a busy port names the flag
that chose it (checked before anything slow, :func:`check_ports`), a missing package names the package;
the traceback follows only at ``--log-level DEBUG``.
"""

from __future__ import annotations

import asyncio
import errno
import inspect
import ipaddress
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.config import opt, require
from services.common.errors import OperatorError, one_line
from services.common.grpc_util import DEFAULT_MAX_MESSAGE_BYTES, server_options
from services.common.kv_mooncake import leave_process
from services.common.logging import write_line
from services.common.malloc_tuning import tune_malloc
from services.common.parent_watch import wait_for_parent_exit
from services.common.tls import TLSConfig

log = logging.getLogger(__name__)
_STARTED = time.monotonic()
"""When this module was imported: early in every service's start, so "ready after" includes loading."""

Hook = Callable[[], Awaitable[None] | None]
READY_PREFIX = "PDSERVE_READY"

_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


@dataclass
class ServerConfig(TLSConfig):
    """gRPC server, metrics endpoint, mTLS and shutdown bounds. Services subclass it to change defaults.

    Everything binds loopback unless told otherwise: internal RPCs are reachable from other hosts only
    when the operator says so (and then they should run with mTLS)."""

    host: str = opt("127.0.0.1", "Address the gRPC server binds (0.0.0.0: every interface; use mTLS then).")
    port: int = opt(0, "gRPC port; 0 picks a free one (reported in the ready line).")
    metrics_host: str = opt("127.0.0.1", "Address the Prometheus /metrics HTTP server binds.")
    metrics_port: int = opt(0, "Prometheus /metrics port; 0 picks a free one, -1 disables it.")
    max_message_bytes: int = opt(DEFAULT_MAX_MESSAGE_BYTES, "Largest gRPC message sent or received (bytes).")
    drain_timeout_s: float = opt(30.0, "On shutdown, longest wait for in-flight work to drain (seconds).")
    grace_s: float = opt(5.0, "On shutdown, grace given to open RPCs by server.stop() after draining (seconds).")
    instance: str = opt("", "Instance name in logs and traces (e.g. the pod name); empty: host:port.")
    trace_dir: str = opt("", "Directory Admin.CaptureTrace writes under (one sub-directory per capture "
                             "session); empty: <system temp>/pdserve-traces.")
    insecure_internal: bool = opt(False, "Serve gRPC without TLS on a --host other than loopback: its RPCs "
                                         "(internal ones included: Prefill, Reserve, PushKV, kvstore Put/Get, "
                                         "Admin) then answer anyone who reaches the address. Without it such a "
                                         "--host needs --tls-cert/--tls-key/--tls-ca; a loopback host serves "
                                         "local processes either way.")
    parent_pid: int = opt(0, "Shut down (draining as on SIGTERM) once the process with this pid is no longer "
                             "this service's parent, i.e. the launcher that started it died, even by SIGKILL; "
                             "`pdserve up` passes its own pid. 0: off.")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.port <= 65535, self, "port", f"must be in [0, 65535], got {self.port}")
        require(-1 <= self.metrics_port <= 65535, self, "metrics_port",
                f"must be in [-1, 65535], got {self.metrics_port}")
        require(self.max_message_bytes >= 1 << 20, self, "max_message_bytes",
                f"must be >= 1 MiB, got {self.max_message_bytes}")
        require(self.drain_timeout_s >= 0, self, "drain_timeout_s", f"must be >= 0, got {self.drain_timeout_s}")
        require(self.grace_s >= 0, self, "grace_s", f"must be >= 0, got {self.grace_s}")
        require(self.parent_pid >= 0, self, "parent_pid", f"must be >= 0, got {self.parent_pid}")
        require(self.tls_enabled or self.insecure_internal or is_loopback(self.host), self, "host",
                f"{self.host}: not loopback and no TLS: every RPC of this service (internal ones included) would "
                "answer anyone who reaches it; give --tls-cert/--tls-key/--tls-ca (mTLS), or --insecure-internal "
                "to serve plaintext knowingly")
        require(not (self.insecure_internal and self.tls_enabled), self, "insecure_internal",
                "give --insecure-internal or --tls-cert/--tls-key/--tls-ca, not both")


def is_loopback(host: str) -> bool:
    """Whether bind address ``host`` is reachable from this host only (127.0.0.0/8, ::1, localhost)."""
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


class StartupError(OperatorError, RuntimeError):
    """Start-up cannot go on; the message is one actionable line: what, which setting, what to do."""


class BindError(StartupError, OSError):
    """A port cannot be bound (in use, or not allowed)."""


def port_problem(host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``host`` right now (None: it can; port 0 always can). Binds with
    SO_REUSEADDR, as the servers do, so a socket in TIME_WAIT is not reported as busy."""
    if port <= 0:
        return None
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]") or ("::" if family == socket.AF_INET6 else "0.0.0.0"), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return "in use by another process"
            return e.strerror or str(e)
    return None


def check_ports(checks: Sequence[tuple[str, int, str]]) -> None:
    """Before anything slow: StartupError for the first (host, port, setting) that cannot be bound, e.g.
    ``("127.0.0.1", 8000, "--http-port / PDSERVE_HTTP_PORT")``."""
    for host, port, setting in checks:
        problem = port_problem(host, port)
        if problem is not None:
            raise BindError(f"cannot bind {_join(host, port)} ({setting}): {problem}; stop whatever holds "
                               f"it (ss -ltnp 'sport = :{port}') or choose another port (0 picks a free one)")


def server_ports(cfg: ServerConfig) -> list[tuple[str, int, str]]:
    """The gRPC and metrics ports a ServerConfig binds, for :func:`check_ports`."""
    out = [(cfg.host, cfg.port, "--port / PDSERVE_PORT")]
    if cfg.metrics_port > 0:
        out.append((cfg.metrics_host, cfg.metrics_port, "--metrics-port / PDSERVE_METRICS_PORT"))
    return out


def run_main(name: str, main: Coroutine[object, object, None], *,
             exit_codes: Mapping[type[BaseException], int] | None = None) -> int:
    """``asyncio.run(main)``; a failure is one line on stderr (``pdserve NAME: error: ...``) and exit 1 (or
    ``exit_codes[type]``), its traceback only when the root logger is at DEBUG. glibc's malloc is tuned
    for a server's large buffers first (:mod:`services.common.malloc_tuning`). A process holding native
    Mooncake objects ends with :func:`~services.common.kv_mooncake.leave_process` (no exit-time teardown)."""
    tune_malloc()
    return leave_process(_run_main(name, main, exit_codes))


def _run_main(name: str, main: Coroutine[object, object, None],
              exit_codes: Mapping[type[BaseException], int] | None) -> int:
    try:
        asyncio.run(main)
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        debug = logging.getLogger().isEnabledFor(logging.DEBUG)
        if debug:
            log.exception("%s failed", name)
        hint = "" if debug else " (--log-level DEBUG shows the traceback)"
        print(f"pdserve {name}: error: {one_line(e)}{hint}", file=sys.stderr, flush=True)
        return next((code for cls, code in (exit_codes or {}).items() if isinstance(e, cls)), 1)


def connectable_host(host: str) -> str:
    """The host a local client dials for a bind address (wildcards become loopback)."""
    return "127.0.0.1" if host in _WILDCARD_HOSTS else host


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class _NameRecorder:
    """Stands in for the server inside generated add_*Servicer_to_server to learn the service name."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[Any]) -> None:
        self.names += [h.service_name() for h in handlers if hasattr(h, "service_name")]
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, name: str, handlers: dict[str, Any]) -> None:
        if name not in self.names:
            self.names.append(name)
        self._server.add_registered_method_handlers(name, handlers)


async def _call(hook: Hook) -> None:
    result = hook()
    if inspect.isawaitable(result):
        await result


class ServiceServer:
    """One grpc.aio server with health, reflection, metrics and the shutdown sequence.

    Construct inside the running event loop. Register servicers with add_service() before start().
    """

    def __init__(self, service: str, config: ServerConfig, *, drain: Hook | None = None,
                 on_shutdown: Hook | None = None) -> None:
        self.service = service
        self.config = config
        self._drain_hook = drain
        self._shutdown_hook = on_shutdown
        self.server: grpc.aio.Server = grpc.aio.server(options=server_options(config.max_message_bytes))
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        # Extra key=value pairs for the ready line (e.g. the router's http=host:port).
        self.extra_ready: dict[str, str] = {}
        # Set once shutdown begins: servicers refuse new work (grpc_util.abort_if_draining).
        self.draining = asyncio.Event()
        self.stopped = asyncio.Event()
        # Set by a second signal or shutdown(force=True): skip the rest of draining (and the grace, if
        # server.stop() has not begun yet).
        self._force = asyncio.Event()
        self.grpc_port = 0
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self._metrics_thread: threading.Thread | None = None
        self._started = False
        self._shutdown_task: asyncio.Task[None] | None = None
        self._signals: list[int] = []

    # -- setup -------------------------------------------------------------------------------------
    def add_service(self, add_to_server: Callable[[Any, Any], None], servicer: Any) -> list[str]:
        """Register ``servicer`` with a generated ``add_XServicer_to_server``; returns the service names."""
        if self._started:
            raise RuntimeError("add_service() after start()")
        recorder = _NameRecorder(self.server)
        add_to_server(servicer, recorder)
        if not recorder.names:
            raise RuntimeError(f"{add_to_server.__name__} registered no named service")
        self.service_names += [n for n in recorder.names if n not in self.service_names]
        return recorder.names

    @property
    def grpc_address(self) -> str:
        """host:port a local client dials."""
        return _join(connectable_host(self.config.host), self.grpc_port)

    @property
    def metrics_address(self) -> str | None:
        if self.metrics_port is None:
            return None
        return _join(connectable_host(self.config.metrics_host), self.metrics_port)

    @property
    def instance(self) -> str:
        return self.config.instance or self.grpc_address

    async def start(self) -> int:
        """Bind and start gRPC and the metrics server; every health status NOT_SERVING. Returns the gRPC port."""
        if self._started:
            raise RuntimeError("start() called twice")
        names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        for name in ("", *self.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        bind = _join(self.config.host, self.config.port)
        try:
            if self.config.tls_enabled:
                port = self.server.add_secure_port(bind, self.config.server_credentials())
            else:  # loopback by default; docs/SECURITY.md says what an insecure port trusts
                port = self.server.add_insecure_port(bind)
        except RuntimeError as e:
            raise BindError(f"{self.service}: cannot bind gRPC on {bind} (--port / PDSERVE_PORT): {e}; "
                               "choose another port (0 picks a free one)") from e
        if port == 0:
            why = port_problem(self.config.host, self.config.port) or "in use by another process?"
            raise BindError(f"{self.service}: cannot bind gRPC on {bind} (--port / PDSERVE_PORT): {why}; "
                               "choose another port (0 picks a free one)")
        self.grpc_port = port
        if self.config.metrics_port >= 0:
            self._start_metrics()
        await self.server.start()
        self._started = True
        log.info("%s started (NOT_SERVING) grpc=%s metrics=%s services=%s", self.service, self.grpc_address,
                 self.metrics_address, ",".join(self.service_names))
        return port

    def _start_metrics(self) -> None:
        try:
            httpd, thread = prometheus_client.start_http_server(self.config.metrics_port, addr=self.config.metrics_host)
        except OSError as e:
            raise BindError(f"{self.service}: cannot bind metrics on "
                               f"{_join(self.config.metrics_host, self.config.metrics_port)} "
                               f"(--metrics-port / PDSERVE_METRICS_PORT): {e.strerror or e}; choose another "
                               "port (0 picks a free one, -1 turns metrics off)") from e
        self._metrics_server, self._metrics_thread = httpd, thread
        self.metrics_port = int(httpd.server_port)

    def ready_line(self) -> str:
        parts = [READY_PREFIX, f"service={self.service}", f"grpc={self.grpc_address}"]
        if self.metrics_address is not None:
            parts.append(f"metrics={self.metrics_address}")
        parts += [f"{k}={v}" for k, v in self.extra_ready.items()]
        parts.append(f"pid={os.getpid()}")
        return " ".join(parts)

    async def set_serving(self) -> None:
        """The service is ready (model loaded, warmed): health SERVING, then the ready line on stdout."""
        if not self._started:
            raise RuntimeError("set_serving() before start()")
        if self.draining.is_set():
            return
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        write_line(self.ready_line())
        log.info("%s SERVING on %s", self.service, self.grpc_address)

    # -- shutdown ----------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT start shutdown(); a second signal cuts draining short."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
            self._signals.append(sig)

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._shutdown_task is None:
            log.info("%s received %s: shutting down", self.service, name)
            self._shutdown_task = asyncio.ensure_future(self._shutdown(name, force=False))
        else:
            log.warning("%s received %s again: stopping now", self.service, name)
            self._force.set()

    async def shutdown(self, reason: str = "shutdown", *, force: bool = False) -> None:
        """Run the shutdown sequence once (later calls wait for the first). ``force``: no drain, no grace."""
        if force:
            self._force.set()
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown(reason, force=force))
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self, reason: str, *, force: bool) -> None:
        self.draining.set()
        await self.health.enter_graceful_shutdown()
        log.info("%s NOT_SERVING (%s): draining up to %.1fs", self.service, reason, self.config.drain_timeout_s)
        if self._drain_hook is not None and not force:
            await self._bounded(self._drain_hook, self.config.drain_timeout_s, "drain")
        grace = 0.0 if self._force.is_set() else self.config.grace_s
        if self._started:
            # One stop() only: a second, concurrent stop() on a grpc.aio server crashes grpc's C core
            # (seen as a segfault), so a later forced shutdown cannot cut this grace short.
            await self.server.stop(grace)
        if self._shutdown_hook is not None:
            await self._bounded(self._shutdown_hook, None, "on_shutdown")
        self._stop_metrics()
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self._signals.clear()
        self.stopped.set()
        log.info("%s stopped", self.service)

    async def _bounded(self, hook: Hook, timeout_s: float | None, what: str) -> None:
        task = asyncio.ensure_future(_call(hook))
        force_wait = asyncio.ensure_future(self._force.wait())
        try:
            done, _ = await asyncio.wait({task, force_wait}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if task not in done:
                log.warning("%s: %s did not finish%s; continuing shutdown", self.service, what,
                            " (forced)" if force_wait in done else f" within {timeout_s:.1f}s")
                task.cancel()
            elif not task.cancelled() and task.exception() is not None:
                log.error("%s: %s failed: %r", self.service, what, task.exception())
        finally:
            force_wait.cancel()
            pending = {t for t in (task, force_wait) if not t.done()}
            if pending:  # both tasks are owned to the end: cancelled above, given a moment to unwind
                await asyncio.wait(pending, timeout=1.0)

    def _stop_metrics(self) -> None:
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        if self._metrics_thread is not None:
            self._metrics_thread.join(timeout=5)
            self._metrics_thread = None

    async def wait_for_termination(self) -> None:
        """Return once shutdown() has finished."""
        await self.stopped.wait()


async def serve(srv: ServiceServer, *, warmup: Hook | None = None) -> None:
    """Run ``srv`` to completion: start, signal handlers, ``warmup`` (load/warm the model; health stays
    NOT_SERVING meanwhile), SERVING + ready line, then wait until a signal or shutdown() stops it.

    If warmup raises, the server is shut down and the error propagates.
    """
    t0 = time.monotonic()
    await srv.start()
    srv.install_signal_handlers()
    orphan_watch = (asyncio.ensure_future(_stop_with_parent(srv))
                    if srv.config.parent_pid else None)
    try:
        await _serve_started(srv, t0, warmup)
    finally:
        if orphan_watch is not None:
            orphan_watch.cancel()
            await asyncio.gather(orphan_watch, return_exceptions=True)


async def _stop_with_parent(srv: ServiceServer) -> None:
    await wait_for_parent_exit(srv.config.parent_pid, srv.service)
    await srv.shutdown("launcher exited")


async def _serve_started(srv: ServiceServer, t0: float, warmup: Hook | None) -> None:
    if warmup is not None:
        log.info("%s: warming up (health NOT_SERVING until done)", srv.service)
        try:
            await _call(warmup)
        except BaseException:
            await srv.shutdown("warmup failed", force=True)
            raise
    await srv.set_serving()
    now = time.monotonic()
    log.info("%s: ready %.1f s after start (%.1f s of it binding and warming up)", srv.service, now - _STARTED,
             now - t0)
    await srv.wait_for_termination()
